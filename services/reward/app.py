"""The reward Serve application: `rlserve.v1.Reward` over the reward plug-ins, and
`rlserve.v1.Environment` over the environment plug-ins (one swappable application).

It is deployed with a default function set (cluster.yaml, or
`deploy/serve swap reward ...`); a request may name its own functions
instead. Environments are named by each Reset/Step request; the built-in
`single_turn` scores with the request's functions or the deployed default.
Episode state travels in the requests (`rlserve.environments.interfaces`),
so the replica keeps nothing per episode. Redeploying this app alone swaps
rewards and environments without touching the other services.
"""

from __future__ import annotations

import asyncio
import logging
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from rlserve.cluster.deployment import build_app
from rlserve.cpu_affinity import place_from_env
from rlserve.environments import serving
from rlserve.environments.loader import Environments
from rlserve.logs import event, setup_logging
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.loader import CombinedReward
from rlserve.rewards.scoring import functions_from_proto, score_batch
from rlserve.rpc import grpc_method, invalid_argument
from rlserve.security.plugins import PluginPolicy
from rlserve.v1 import environment_pb2, reward_pb2

log = logging.getLogger("rlserve.reward")


class RewardArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The deployed default (the operator's choice: cluster file or `deploy/serve swap reward`).
    functions: list[RewardFunctionCfg] = [RewardFunctionCfg(name="exact_match")]
    # Plug-ins a request may name by import path (the cluster file's reward.allowed_plugins).
    allowed_plugins: list[str] = []
    # Model folders reward_model / llm_judge may load (the cluster file's reward.allowed_models).
    allowed_models: list[str] = []
    # Threads that run environments' Reset and Step (a hung plug-in holds one until it returns).
    environment_threads: int = Field(64, ge=1, le=4096)


@lru_cache(maxsize=32)
def _combined(keys: tuple[str, ...]) -> CombinedReward:
    """Loaded plug-ins by their descriptions' keys (a request names the same functions step after step)."""
    return CombinedReward([RewardFunctionCfg.model_validate_json(k) for k in keys])


@serve.deployment(max_ongoing_requests=256)
class Reward:
    def __init__(self, args: dict | None = None):
        setup_logging()
        place_from_env()
        parsed = RewardArgs.model_validate(args or {})
        self.default = CombinedReward(parsed.functions)
        self.plugins = PluginPolicy(parsed.allowed_plugins, parsed.allowed_models)
        self.env_threads = serving.EnvironmentThreads(parsed.environment_threads)
        self.environments = Environments(self.plugins, self.default)
        event(log, "reward.ready", version=self.default.version,
              functions=",".join(s.name for s in self.default.specs))

    @grpc_method
    async def Score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        reward = self.default
        if request.functions:
            keys = tuple(f.key() for f in functions_from_proto(list(request.functions), self.plugins))
            try:
                # In a thread: the first call of a reward model or judge loads it (seconds).
                reward = await asyncio.to_thread(_combined, keys)
            except ValueError as err:
                raise invalid_argument("functions", str(err)) from None
        return await asyncio.to_thread(score_batch, reward, request)

    @grpc_method
    async def Reset(self, request: environment_pb2.ResetRequest) -> environment_pb2.ResetResponse:
        env, version = self.environments.get(request.environment)
        return await self.env_threads.reset(env, version, request)

    @grpc_method
    async def Step(self, request: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        env, version = self.environments.get(request.environment)
        return await self.env_threads.step(env, version, request)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.reward.app:build`)."""
    return build_app(Reward, RewardArgs, args)

