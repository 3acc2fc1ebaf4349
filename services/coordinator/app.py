"""The coordinator Serve application: the public `rlserve.v1.Coordinator` API.

SubmitRun checks what it can before queueing (the spec, the model and
whether the learner backend can train it, the data, the rollout's
architecture, the reward functions), so a run that
cannot work is refused with the field named instead of failing later.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from transformers import AutoConfig

from rlserve.cluster.deployment import build_app
from rlserve.config import RunSpec
from rlserve.data.dataset import build_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.learner.registry import UnsupportedModel, check_model
from rlserve.logs import setup_logging
from rlserve.models import resolve_model
from rlserve.rollout.deployed import match_generation
from rlserve.rpc import failed_precondition, grpc_method, invalid_argument
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2
from rlserve.weights.specs import checkpoint_specs, fingerprint
from rlserve.weights.store import DEFAULT_STORE_NAME
from services.coordinator.calls import RetryPolicy, ServiceCalls, ServiceFailure
from services.coordinator.loop import LoopSettings, run_grpo
from services.coordinator.rollouts import reward_functions
from services.coordinator.runs import RunManager

log = logging.getLogger("rlserve.coordinator")


class CoordinatorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runs_dir: str = "runs"
    apps: dict[str, str] = {"rollout": "rollout", "reward": "reward", "reference": "reference",
                            "learner": "learner"}
    weight_store: str = DEFAULT_STORE_NAME
    # The rollout and learner services hold one policy at a time: a second run's Configure would
    # tear down the first run's learner. Runs are queued until they can share the cluster.
    max_concurrent_runs: int = 1
    watchdog_timeout_s: float = Field(1200.0, gt=0)
    retry: RetryPolicy = RetryPolicy()

    @field_validator("max_concurrent_runs")
    @classmethod
    def _one_run_at_a_time(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"must be 1, got {v}: runs cannot share the rollout and learner services yet "
                             f"(a second run would reconfigure the first run's learner); they are queued")
        return v


@serve.deployment(max_ongoing_requests=64)
class Coordinator:
    def __init__(self, args: dict | None = None):
        setup_logging()
        self.args = CoordinatorArgs.model_validate(args or {})
        self.settings = LoopSettings(apps=self.args.apps, weight_store=self.args.weight_store,
                                     retry=self.args.retry,
                                     watchdog_timeout_s=self.args.watchdog_timeout_s)
        self.manager = RunManager(Path(self.args.runs_dir), lambda run: run_grpo(run, self.settings),
                                  self._check, self.args.max_concurrent_runs)

    async def _check(self, spec: RunSpec) -> RunSpec:
        """Refuse, at submission, a run that cannot work on this cluster; returns the spec with the
        generation settings of the deployed rollout filled in."""
        try:
            model = resolve_model(spec.policy.model_name, spec.policy.model_seed)
        except ValueError as err:
            raise invalid_argument("policy.model_name", str(err).removeprefix("policy.model_name: ")) from None
        try:
            splits = build_splits(spec.data)
        except ValueError as err:
            raise invalid_argument("data", str(err)) from None
        try:
            check_model(spec, AutoConfig.from_pretrained(model))
        except UnsupportedModel as err:
            raise failed_precondition(str(err)) from None
        tok = PromptTokenizer(model)
        room = spec.policy.max_total_sequence_length - spec.policy.generation.max_new_tokens
        longest = max(len(tok.encode(ex.prompt)) for ex in splits.train[:2000] + splits.val)
        if longest > room:
            raise invalid_argument("policy.max_total_sequence_length",
                                   f"a prompt of {longest} tokens + max_new_tokens "
                                   f"{spec.policy.generation.max_new_tokens} do not fit "
                                   f"{spec.policy.max_total_sequence_length}")
        calls = ServiceCalls(self.settings.apps, spec.reward.endpoint, RetryPolicy(retries=1, timeout_s=60),
                             on_retry=lambda msg: None)
        try:
            info = await calls.rollout_info()
            spec, problems = match_generation(spec, info)
            if problems:
                raise failed_precondition("; ".join(problems))
            if info.architecture_fingerprint != fingerprint(checkpoint_specs(model)):
                raise failed_precondition(f"policy.model_name: {spec.policy.model_name} does not have the "
                                          f"architecture of the model the rollout service serves ({info.model})")
            if info.max_model_len < spec.policy.max_total_sequence_length:
                raise failed_precondition(f"policy.max_total_sequence_length {spec.policy.max_total_sequence_length}"
                                          f" exceeds the rollout's max_model_len {info.max_model_len}")
            await calls.score(reward_pb2.ScoreRequest(functions=reward_functions(spec)))
        except ServiceFailure as err:
            raise failed_precondition(f"reward.functions or services: {err}") from None
        finally:
            await calls.close()
        return spec

    @grpc_method
    async def SubmitRun(self, request: pb.SubmitRunRequest) -> pb.SubmitRunResponse:
        run = await self.manager.submit(request.spec_yaml, request.run_id, request.resume)
        return pb.SubmitRunResponse(run=run.to_proto())

    @grpc_method
    async def GetRun(self, request: pb.GetRunRequest) -> pb.GetRunResponse:
        return pb.GetRunResponse(run=self.manager.get(request.run_id).to_proto())

    @grpc_method
    async def ListRuns(self, request: pb.ListRunsRequest) -> pb.ListRunsResponse:
        del request
        return pb.ListRunsResponse(runs=[r.to_proto() for r in self.manager.runs.values()])

    @grpc_method
    async def CancelRun(self, request: pb.CancelRunRequest) -> pb.CancelRunResponse:
        return pb.CancelRunResponse(run=self.manager.cancel(request.run_id).to_proto())

    @grpc_method
    async def WatchRun(self, request: pb.WatchRunRequest):
        run = self.manager.get(request.run_id)
        async for ev in run.watch(request.from_sequence):
            yield pb.WatchRunResponse(event=ev)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.coordinator.app:build`)."""
    return build_app(Coordinator, CoordinatorArgs, args)

