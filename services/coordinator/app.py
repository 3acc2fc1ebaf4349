"""The coordinator Serve application: the public `rlserve.v1.Coordinator` API.

SubmitRun answers quickly and never builds a data set or a model in the
request handler: it checks what is cheap (the spec and its bounds, the run
id, that named files lie in the cluster's directories and named plug-ins and
reward servers are allow-listed, the rollout's model length, and whether the
learner backend can train the model, from its config alone) and queues the
run. A preflight then checks, off the request path and within
`preflight_timeout_s`, what needs the model or the data (the architecture
against the rollout's, prompt lengths on a bounded sample, the reward
functions); a run that cannot work fails there with the field named, before
it takes the learner.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from pathlib import Path

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from transformers import AutoConfig

from rlserve.cluster.deployment import build_app
from rlserve.config import RunSpec
from rlserve.cpu_affinity import pin_from_env
from rlserve.data.dataset import build_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.learner.registry import UnsupportedModel, check_model
from rlserve.logs import setup_logging
from rlserve.models import get_preset, resolve_model
from rlserve.models.factory import architecture_config
from rlserve.rollout.deployed import match_generation
from rlserve.rpc import failed_precondition, grpc_method, invalid_argument, permission_denied
from rlserve.security.paths import PathsArgs
from rlserve.security.plugins import PluginPolicy
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2
from rlserve.weights.specs import checkpoint_specs, fingerprint
from rlserve.weights.store import DEFAULT_STORE_NAME
from services.coordinator.calls import RetryPolicy, ServiceCalls, ServiceFailure
from services.coordinator.recovery import LoopSettings, run_grpo
from services.coordinator.rollouts import reward_functions
from services.coordinator.runs import RunManager

log = logging.getLogger("rlserve.coordinator")
# Prompts whose length the preflight checks (the data set's first ones, and every validation prompt).
PREFLIGHT_SAMPLE = 2000


class CoordinatorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paths: PathsArgs = PathsArgs()
    # The cluster file's reward.allowed_plugins and reward.allowed_endpoints.
    allowed_plugins: list[str] = []
    allowed_endpoints: list[str] = []
    apps: dict[str, str] = {"rollout": "rollout", "reward": "reward", "reference": "reference",
                            "learner": "learner"}
    weight_store: str = DEFAULT_STORE_NAME
    # The rollout and learner services hold one policy at a time: a second run's Configure would
    # tear down the first run's learner. Runs are queued until they can share the cluster.
    max_concurrent_runs: int = 1
    watchdog_timeout_s: float = Field(1200.0, gt=0)
    retry: RetryPolicy = RetryPolicy()
    # Runs an earlier coordinator left running continue from their last checkpoint when this one
    # starts (and their spec's checkpointing.auto_resume is on); false: they are marked FAILED.
    resume_on_restart: bool = True
    # Time for a run's preflight (it may generate a preset model first).
    preflight_timeout_s: float = Field(300.0, gt=0)
    # Largest JSONL data file a spec may name.
    max_data_file_mb: int = Field(512, ge=1)

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
        pin_from_env()
        self.args = CoordinatorArgs.model_validate(args or {})
        self.paths = self.args.paths.policy()
        self.plugins = PluginPolicy(self.args.allowed_plugins)
        self.settings = LoopSettings(apps=self.args.apps, weight_store=self.args.weight_store,
                                     retry=self.args.retry,
                                     watchdog_timeout_s=self.args.watchdog_timeout_s)
        self.manager = RunManager(self.paths.runs_dir, lambda run: run_grpo(run, self.settings),
                                  self._check, self._preflight, self.args.preflight_timeout_s,
                                  self.args.max_concurrent_runs, self.args.resume_on_restart)

    async def __del__(self) -> None:
        """Serve's shutdown of this replica: stop the runs without changing their state (they stay RUNNING
        on disk, and the next coordinator resumes them)."""
        await self.manager.shutdown()

    async def _check(self, spec: RunSpec) -> RunSpec:
        """Cheap checks on the request path; returns the spec with its files as confined absolute paths
        and the generation settings of the deployed rollout filled in."""
        for i, f in enumerate(spec.reward.functions):
            if f.import_path:
                self.plugins.check(f"spec_yaml: reward.functions.{i}.import_path", f.import_path)
        endpoint = spec.reward.endpoint
        if endpoint and not any(fnmatch.fnmatchcase(endpoint, pat) for pat in self.args.allowed_endpoints):
            raise permission_denied("spec_yaml: reward.endpoint", f"{endpoint!r} is not a reward server this "
                                    f"cluster allows; an operator can add it to `reward.allowed_endpoints` "
                                    f"in the cluster file")
        spec = spec.model_copy(deep=True)
        spec.policy.model_name = self.paths.model_name("spec_yaml: policy.model_name", spec.policy.model_name)
        try:
            config = await asyncio.to_thread(_model_config, spec.policy.model_name)
        except (OSError, ValueError) as err:
            raise invalid_argument("spec_yaml: policy.model_name", str(err)) from None
        try:
            check_model(spec, config)
        except UnsupportedModel as err:
            raise failed_precondition(str(err)) from None
        for key in ("train_path", "val_path"):
            value = getattr(spec.data, key)
            if value is None:
                continue
            field = f"spec_yaml: data.{key}"
            path = self.paths.data(field, value)
            if not path.is_file():
                raise invalid_argument(field, f"{value[:200]!r}: no such file")
            if path.stat().st_size > self.args.max_data_file_mb * 2**20:
                raise invalid_argument(field, f"{value[:200]!r} is larger than {self.args.max_data_file_mb} MB")
            setattr(spec.data, key, str(path))
        calls = ServiceCalls(self.settings.apps, None, RetryPolicy(retries=1, timeout_s=30),
                             on_retry=lambda msg: None)
        try:
            info = await calls.rollout_info()
        except ServiceFailure as err:
            raise failed_precondition(f"the rollout service does not answer: {err}") from None
        finally:
            await calls.close()
        spec, problems = match_generation(spec, info)
        if problems:
            raise failed_precondition("; ".join(problems))
        if info.max_model_len < spec.policy.max_total_sequence_length:
            raise failed_precondition(f"policy.max_total_sequence_length {spec.policy.max_total_sequence_length}"
                                      f" exceeds the rollout's max_model_len {info.max_model_len}")
        return spec

    async def _preflight(self, spec: RunSpec) -> None:
        """What needs the model or the data, off the request path (the run manager bounds its time)."""
        try:
            model = await asyncio.to_thread(resolve_model, spec.policy.model_name, spec.policy.model_seed)
        except ValueError as err:
            raise invalid_argument("policy.model_name", str(err).removeprefix("policy.model_name: ")) from None
        try:
            # A bounded sample: the run builds the whole data set itself, in a worker thread.
            splits = await asyncio.to_thread(build_splits, spec.data, PREFLIGHT_SAMPLE)
        except ValueError as err:
            raise invalid_argument("data", str(err)) from None
        try:
            tok = PromptTokenizer(model, spec.data.prompt_format, spec.data.system_prompt)
        except ValueError as err:
            raise failed_precondition(str(err)) from None
        room = spec.policy.max_total_sequence_length - spec.policy.generation.max_new_tokens
        try:
            longest = await asyncio.to_thread(lambda: max(len(tok.prompt_ids(ex)) for ex in splits.train + splits.val))
        except TemplateError as err:
            raise invalid_argument("data.prompt_format", f"the model's chat template fails on this data: "
                                   f"{type(err).__name__}: {err}") from None
        if longest > room:
            raise invalid_argument("policy.max_total_sequence_length",
                                   f"a prompt of {longest} tokens + max_new_tokens "
                                   f"{spec.policy.generation.max_new_tokens} do not fit "
                                   f"{spec.policy.max_total_sequence_length}")
        calls = ServiceCalls(self.settings.apps, spec.reward.endpoint, RetryPolicy(retries=1, timeout_s=60),
                             on_retry=lambda msg: None)
        try:
            info = await calls.rollout_info()
            served = await asyncio.to_thread(lambda: fingerprint(checkpoint_specs(model)))
            if info.architecture_fingerprint != served:
                raise failed_precondition(f"policy.model_name: {spec.policy.model_name} does not have the "
                                          f"architecture of the model the rollout service serves ({info.model})")
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
        return pb.ListRunsResponse(runs=self.manager.list_protos())

    @grpc_method
    async def CancelRun(self, request: pb.CancelRunRequest) -> pb.CancelRunResponse:
        return pb.CancelRunResponse(run=self.manager.cancel(request.run_id).to_proto())

    @grpc_method
    async def WatchRun(self, request: pb.WatchRunRequest):
        run = self.manager.get(request.run_id)
        async for ev in run.watch(request.from_sequence):
            yield pb.WatchRunResponse(event=ev)


def _model_config(model_name: str):
    """The HF config of `policy.model_name` without building the model: the folder's config.json, or a
    preset's architecture (`architecture_config`)."""
    if model_name.startswith("preset:"):
        return architecture_config(get_preset(model_name.removeprefix("preset:")))
    return AutoConfig.from_pretrained(Path(model_name))


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.coordinator.app:build`).

    A new coordinator replica resumes the runs it finds running on disk, so a redeploy must stop the
    old replica before the new one starts (no surge), or two coordinators would drive one run.
    """
    return build_app(Coordinator, CoordinatorArgs, {**args, "deployment": {**args.get("deployment", {}),
                                                                          "max_surge_percent": 0}})

