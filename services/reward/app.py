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
import hashlib
import json
import logging
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from rlserve.cluster.deployment import build_app
from rlserve.cpu_affinity import pin_from_env
from rlserve.environments import serving
from rlserve.environments.config import BadEnvironment, EnvironmentCfg
from rlserve.environments.interfaces import Environment
from rlserve.environments.loader import load_environment, single_turn_functions
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
    # Threads that run environments' Reset and Step (a hung plug-in holds one until it returns).
    environment_threads: int = Field(64, ge=1, le=4096)


@lru_cache(maxsize=32)
def _combined(keys: tuple[str, ...]) -> CombinedReward:
    """Loaded plug-ins by their descriptions' keys (a request names the same functions step after step)."""
    return CombinedReward([RewardFunctionCfg.model_validate_json(k) for k in keys])


@lru_cache(maxsize=32)
def _environment(key: str, default_key: str) -> tuple[Environment, str]:
    """A loaded environment and its version, by its description's key (and the deployed default's, which
    `single_turn` without functions scores with)."""
    cfg = EnvironmentCfg.model_validate_json(key)
    default = tuple(RewardFunctionCfg.model_validate_json(k) for k in json.loads(default_key))
    env = load_environment(cfg, lambda: _combined(tuple(f.key() for f in default)))
    return env, hashlib.sha1(f"{key}\n{default_key}".encode()).hexdigest()[:12]


@serve.deployment(max_ongoing_requests=256)
class Reward:
    def __init__(self, args: dict | None = None):
        setup_logging()
        pin_from_env()
        parsed = RewardArgs.model_validate(args or {})
        self.default = CombinedReward(parsed.functions)
        self.plugins = PluginPolicy(parsed.allowed_plugins)
        self.env_threads = serving.EnvironmentThreads(parsed.environment_threads)
        event(log, "reward.ready", version=self.default.version,
              functions=",".join(s.name for s in self.default.specs))

    @grpc_method
    async def Score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        reward = self.default
        if request.functions:
            try:
                reward = _combined(tuple(f.key() for f in functions_from_proto(list(request.functions),
                                                                               self.plugins)))
            except ValueError as err:
                raise invalid_argument("functions", str(err)) from None
        return await asyncio.to_thread(score_batch, reward, request)

    def _environment(self, spec: environment_pb2.EnvironmentSpec) -> tuple[Environment, str]:
        """The request's environment; plug-ins by import path (its own, or its reward functions') must be
        allow-listed."""
        try:
            cfg = EnvironmentCfg.from_proto(spec)
        except BadEnvironment as err:
            raise invalid_argument(f"environment.{err.field}", err.problem) from None
        if cfg.import_path:
            self.plugins.check("environment.import_path", cfg.import_path)
        try:
            if cfg.import_path is None and cfg.name == "single_turn":
                for i, f in enumerate(single_turn_functions(cfg)):
                    if f.import_path:
                        self.plugins.check(f"environment.args_json: functions.{i}.import_path", f.import_path)
            default = json.dumps([f.key() for f in self.default.specs])
            return _environment(cfg.key(), default)
        except ValueError as err:
            raise invalid_argument("environment", str(err)) from None

    @grpc_method
    async def Reset(self, request: environment_pb2.ResetRequest) -> environment_pb2.ResetResponse:
        env, version = self._environment(request.environment)
        return await self.env_threads.reset(env, version, request)

    @grpc_method
    async def Step(self, request: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        env, version = self._environment(request.environment)
        return await self.env_threads.step(env, version, request)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.reward.app:build`)."""
    return build_app(Reward, RewardArgs, args)

