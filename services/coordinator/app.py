"""The coordinator Serve application: the public `rlserve.v1.Coordinator` API.

Each RPC decodes, calls the run manager (`rlserve.runs.manager`), and
encodes. The gateway passes the caller's principal after the request; a call
that passes none comes from inside the cluster and runs as `system` (an
admin). Runs are admitted by `rlserve.loop.admission` and executed by
`rlserve.loop.recovery.run_to_end`, which reaches the other applications
through `handles.ServeServices`. It also serves `rlserve.v1.Agents` for its
external_agent runs (`rlserve.agents.hub`: the runs' sessions meet the RPCs in
one `AgentSessions` table), and the Tinker API's operations for the gateway
(`tinker`: `rlserve.tinker`, each model a run of this manager).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from rlserve.agents.hub import AgentHub
from rlserve.agents.table import AgentSessions
from rlserve.cluster.deployment import build_app
from rlserve.cpu_affinity import place_from_env
from rlserve.logs import setup_logging
from rlserve.loop.admission import RunAdmission
from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import run_to_end
from rlserve.loop.retry import RetryPolicy
from rlserve.loop.services import RunServices
from rlserve.rpc import grpc_method
from rlserve.runs.feed import run_feed
from rlserve.runs.manager import RunManager
from rlserve.runs.record import Run
from rlserve.runs.spec_reader import SpecReader
from rlserve.security.paths import PathsArgs
from rlserve.security.plugins import PluginPolicy
from rlserve.security.principal import SYSTEM, Principal
from rlserve.tenancy.legacy import COORDINATOR_ARGS, log_deprecated, migrate_args
from rlserve.tenancy.live import LiveTenancy
from rlserve.tenancy.policy import TenancyPolicy
from rlserve.tinker.api import Reply
from rlserve.tinker.backends import ServiceSampler, ServiceTrainer
from rlserve.tinker.calls import TinkerCalls
from rlserve.tinker.runs import ManagerRuns
from rlserve.tinker.service import TinkerConfig, TinkerService
from rlserve.v1 import agents_pb2
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.weights.store import DEFAULT_STORE_NAME
from services.coordinator.handles import ServeServices, TinkerHandles

# A run feed ends after this long and the gateway opens the next (`rlserve.runs.feed`).
RUN_FEED_MAX_S = 60.0
APPS = {"rollout": "rollout", "reward": "reward", "reference": "reference", "learner": "learner"}
log = logging.getLogger("rlserve.coordinator")


class CoordinatorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paths: PathsArgs = PathsArgs()
    # The cluster file's reward.allowed_plugins, reward.allowed_models and reward.allowed_endpoints.
    allowed_plugins: list[str] = []
    allowed_models: list[str] = []
    allowed_endpoints: list[str] = []
    apps: dict[str, str] = APPS
    weight_store: str = DEFAULT_STORE_NAME
    watchdog_timeout_s: float = Field(1200.0, gt=0)
    # The rollout generates on CPU cores a CPU learner shares (`async_grpo.enabled: auto` picks sync then).
    generation_shares_cpu_cores: bool = False
    retry: RetryPolicy = RetryPolicy()
    # Runs an earlier coordinator left running continue from their last checkpoint when this one
    # starts (and their spec's checkpointing.auto_resume is on); false: they are marked FAILED.
    resume_on_restart: bool = True
    # Time for a run's preflight (it may generate a preset model first).
    preflight_timeout_s: float = Field(300.0, gt=0)
    # A cancelled run is CANCELLED within this long, even if its task is still winding down.
    cancel_grace_s: float = Field(60.0, gt=0, le=3600)
    # Largest JSONL data file a spec may name.
    max_data_file_mb: int = Field(512, ge=1)
    # A WatchRun stream ends after this long (clients continue from the next event); none is held for good.
    watch_max_s: float = Field(600.0, gt=0)
    # The limits (the cluster file's `tenancy` when it was deployed), and the cluster file, whose `tenancy`
    # section is re-read when it changes (None: the deployed limits stay).
    tenancy: TenancyPolicy = TenancyPolicy()
    cluster_file: str | None = None
    # Old keys of the limits these args were given (max_queued_runs, max_concurrent_runs, quotas,
    # spec_reading_share), each with its `tenancy` key: read as that key, and logged at start.
    deprecated_keys: dict[str, str] = {}
    # How often the gateway's copy of the runs is brought up to date (a run's own progress shows within it).
    run_feed_interval_s: float = Field(0.1, gt=0, le=10)
    # With every run finished, the feed sleeps until a run is submitted, resumed or opened, looking again
    # after this long at most (an idle coordinator does not wake every `run_feed_interval_s`).
    run_feed_idle_s: float = Field(5.0, gt=0, le=60)
    # The Tinker API's models (the gateway's /api/v1): bases, limits (rlserve.tinker.service.TinkerConfig).
    tinker: TinkerConfig = TinkerConfig()

    @model_validator(mode="before")
    @classmethod
    def _old_tenancy_keys(cls, data: Any) -> Any:
        return migrate_args(data, COORDINATOR_ARGS)


# Idle WatchRun streams are awaiting coroutines: the gateway bounds each caller's share
# (rlserve.tenancy.callers); this bounds them all together. Streams (WatchRun, the gateway's run feed)
# would hold up a redeploy or `deploy/serve down` for Serve's default 20 s: after 3 s they are cut (a
# client's WatchRun continues from its next event, the gateway opens a new feed, runs resume in the
# next coordinator).
@serve.deployment(max_ongoing_requests=4096, graceful_shutdown_timeout_s=3)
class Coordinator:
    def __init__(self, args: dict | None = None):
        setup_logging()
        place_from_env()
        self.args = CoordinatorArgs.model_validate(args or {})
        plugins = PluginPolicy(self.args.allowed_plugins, self.args.allowed_models)
        admission = RunAdmission(self.args.paths.policy(), plugins,
                                  self.args.allowed_endpoints, self.args.max_data_file_mb, self._services)
        log_deprecated(log, "the coordinator's args", self.args.deprecated_keys)
        tenancy = LiveTenancy(self.args.tenancy, Path(self.args.cluster_file) if self.args.cluster_file else None)
        self.manager = RunManager(self.args.paths.policy().runs_dir, self._run, admission,
                                  self.args.preflight_timeout_s, self.args.resume_on_restart, tenancy,
                                  SpecReader(tenancy.policy.callers), self.args.cancel_grace_s)
        self.agent_sessions = AgentSessions()
        self.agents = AgentHub(self.agent_sessions, self.manager.get)
        handles = TinkerHandles(self.args.apps)
        sampler = ServiceSampler(handles)
        self.tinker_calls = TinkerCalls(TinkerService(self.args.tinker, self.args.paths.policy().runs_dir,
                                                      ServiceTrainer(handles), sampler, ManagerRuns(self.manager),
                                                      sampler.deployment))

    def _services(self, reward_endpoint: str | None, policy: RetryPolicy, env_endpoint: str | None = None
                  ) -> RunServices:
        return ServeServices(self.args.apps, reward_endpoint, policy, on_retry=lambda msg: None,
                             env_endpoint=env_endpoint, agents=self.agent_sessions)

    async def _run(self, run: Run) -> None:
        services = await ServeServices.connect(self.args.apps, run.spec.reward.endpoint, self.args.retry,
                                               lambda msg: run.emit(pb.EVENT_KIND_RETRY, msg),
                                               self.args.watchdog_timeout_s,
                                               env_endpoint=run.spec.env.endpoint if run.spec.env.enabled else None,
                                               agents=self.agent_sessions)
        try:
            await run_to_end(run, services, LoopSettings(self.args.weight_store, self.args.watchdog_timeout_s,
                                                              self.args.generation_shares_cpu_cores))
        finally:
            self.agent_sessions.close(run.run_id)

    async def __del__(self) -> None:
        """Serve's shutdown of this replica: stop the runs without changing their state (they stay RUNNING
        on disk, and the next coordinator resumes them)."""
        await self.manager.shutdown()

    async def run_feed(self):
        """The gateway's run table and its runs' events (`rlserve.runs.feed`): not an RPC, called by handle."""
        async for batch in run_feed(lambda: self.manager.runs, self.args.run_feed_interval_s, RUN_FEED_MAX_S,
                                    self.manager.arrivals, self.args.run_feed_idle_s):
            yield batch

    @grpc_method
    async def SubmitRun(self, request: pb.SubmitRunRequest, caller: Principal = SYSTEM) -> pb.SubmitRunResponse:
        run = await self.manager.submit(request.spec_yaml, request.run_id, request.resume, caller)
        return pb.SubmitRunResponse(run=run.to_proto())

    @grpc_method
    async def GetRun(self, request: pb.GetRunRequest, caller: Principal = SYSTEM) -> pb.GetRunResponse:
        return pb.GetRunResponse(run=self.manager.get(request.run_id, caller).to_proto())

    @grpc_method
    async def ListRuns(self, request: pb.ListRunsRequest, caller: Principal = SYSTEM) -> pb.ListRunsResponse:
        del request
        return pb.ListRunsResponse(runs=self.manager.list_protos(caller))

    @grpc_method
    async def CancelRun(self, request: pb.CancelRunRequest, caller: Principal = SYSTEM) -> pb.CancelRunResponse:
        run = self.manager.cancel(request.run_id, caller)
        return pb.CancelRunResponse(run=run.to_proto())

    @grpc_method
    async def WatchRun(self, request: pb.WatchRunRequest, caller: Principal = SYSTEM):
        run = self.manager.get(request.run_id, caller)
        async for ev in run.watch(request.from_sequence, self.args.watch_max_s):
            yield pb.WatchRunResponse(event=ev)

    async def tinker(self, caller: Principal, op: str, *args: Any) -> Reply:
        """An operation of the Tinker API (`rlserve.tinker.calls`) for the gateway's /api/v1: not an RPC, called by
        handle; its models are runs of this manager."""
        return await self.tinker_calls.call(caller, op, *args)

    # --- rlserve.v1.Agents ------------------------------------------------------------------------

    @grpc_method
    async def NextEpisode(self, request: agents_pb2.NextEpisodeRequest,
                          caller: Principal = SYSTEM) -> agents_pb2.NextEpisodeResponse:
        return await self.agents.next_episode(request, caller)

    @grpc_method
    async def StartEpisode(self, request: agents_pb2.StartEpisodeRequest,
                           caller: Principal = SYSTEM) -> agents_pb2.StartEpisodeResponse:
        return await self.agents.start_episode(request, caller)

    @grpc_method
    async def Chat(self, request: agents_pb2.ChatRequest, caller: Principal = SYSTEM) -> agents_pb2.ChatResponse:
        return await self.agents.chat(request, caller)

    @grpc_method
    async def EndEpisode(self, request: agents_pb2.EndEpisodeRequest,
                         caller: Principal = SYSTEM) -> agents_pb2.EndEpisodeResponse:
        return await self.agents.end_episode(request, caller)


def build(args: dict) -> serve.Application:
    """Serve application builder (`import_path: services.coordinator.app:build`).

    A new coordinator replica resumes the runs it finds running on disk, so a redeploy must stop the
    old replica before the new one starts (no surge), or two coordinators would drive one run.
    """
    return build_app(Coordinator, CoordinatorArgs, {**args, "deployment": {**args.get("deployment", {}),
                                                                          "max_surge_percent": 0}})
