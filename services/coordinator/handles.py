"""`RunServices` over Serve handles: how the coordinator's runs reach the other applications.

Every call goes through `Retrying` (back-off, time-outs, RETRY events). The
training batch travels through the object store (one `ray.put`, its ref
inside a list so Serve hands it over instead of resolving it); the run's
resolved spec goes to Configure as the object itself (the learner parses no
YAML). An external
reward server (`reward.endpoint`) or environment server (`env.endpoint`) is
called over gRPC instead of the reward application.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import ray
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from rlserve.agents.table import AgentSessions
from rlserve.config import RunSpec
from rlserve.loop.retry import Retrying, RetryPolicy
from rlserve.loop.services import Capacity, RunServices, ServiceFailure
from rlserve.rpc import status_of
from rlserve.training.batch import TrainBatch
from rlserve.v1 import (
    environment_pb2,
    environment_pb2_grpc,
    learner_pb2,
    reference_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
)


class ServeServices(RunServices):
    def __init__(self, apps: dict[str, str], reward_endpoint: str | None, policy: RetryPolicy,
                 on_retry: Callable[[str], None], env_endpoint: str | None = None,
                 agents: AgentSessions | None = None):
        self.agents = agents
        self.rollout = serve.get_app_handle(apps["rollout"])
        self.reward = serve.get_app_handle(apps["reward"])
        self.reference = serve.get_app_handle(apps["reference"])
        self.learner = serve.get_app_handle(apps["learner"])
        self.retrying = Retrying(policy, on_retry)
        self._reward_channel = grpc.aio.insecure_channel(reward_endpoint) if reward_endpoint else None
        self._reward_stub = reward_pb2_grpc.RewardStub(self._reward_channel) if reward_endpoint else None
        self._env_channel = grpc.aio.insecure_channel(env_endpoint) if env_endpoint else None
        self._env_stub = environment_pb2_grpc.EnvironmentStub(self._env_channel) if env_endpoint else None

    @classmethod
    async def connect(cls, apps: dict[str, str], reward_endpoint: str | None, policy: RetryPolicy,
                      on_retry: Callable[[str], None], timeout_s: float,
                      env_endpoint: str | None = None, agents: AgentSessions | None = None) -> ServeServices:
        """Once every application exists: a coordinator that resumes runs as it starts comes up beside the
        other applications, not after them."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(apps, reward_endpoint, policy, on_retry, env_endpoint, agents)
            except RayServeException as err:
                if time.monotonic() > deadline:
                    raise ServiceFailure(f"the services are not deployed after {timeout_s:.0f}s: {err}") from None
                await asyncio.sleep(2.0)

    def oldest_pending(self) -> tuple[str, float] | None:
        return self.retrying.oldest_pending()

    async def close(self) -> None:
        for channel in (self._reward_channel, self._env_channel):
            if channel is not None:
                await channel.close()

    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        return await self.retrying.call("rollout.Generate", lambda: self.rollout.Generate.remote(req))

    async def update_weights(self, req: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        return await self.retrying.call("rollout.UpdateWeights", lambda: self.rollout.UpdateWeights.remote(req))

    async def rollout_info(self) -> rollout_pb2.GetInfoResponse:
        return await self.retrying.call("rollout.GetInfo",
                                        lambda: self.rollout.GetInfo.remote(rollout_pb2.GetInfoRequest()))

    async def score(self, req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        if self._reward_stub is not None:
            return await self.retrying.call("reward.Score", lambda: self._reward_stub.Score(req))
        return await self.retrying.call("reward.Score", lambda: self.reward.Score.remote(req))

    async def env_reset(self, req: environment_pb2.ResetRequest) -> environment_pb2.ResetResponse:
        if self._env_stub is not None:
            return await self.retrying.call("environment.Reset", lambda: self._env_stub.Reset(req))
        return await self.retrying.call("environment.Reset", lambda: self.reward.Reset.remote(req))

    async def env_step(self, req: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        if self._env_stub is not None:
            return await self.retrying.call("environment.Step", lambda: self._env_stub.Step(req))
        return await self.retrying.call("environment.Step", lambda: self.reward.Step.remote(req))

    async def reference_logprobs(self, req: reference_pb2.LogProbsRequest) -> reference_pb2.LogProbsResponse:
        return await self.retrying.call("reference.LogProbs", lambda: self.reference.LogProbs.remote(req))

    async def configure(self, req: learner_pb2.ConfigureRequest, spec: RunSpec) -> learner_pb2.ConfigureResponse:
        return await self.retrying.call("learner.Configure", lambda: self.learner.Configure.remote(req, spec))

    async def train_step(self, req: learner_pb2.TrainStepRequest, batch: TrainBatch) -> learner_pb2.TrainStepResponse:
        ref = ray.put(batch)
        return await self.retrying.call("learner.TrainStep", lambda: self.learner.TrainStep.remote(req, [ref]))

    async def export_weights(self, req: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        return await self.retrying.call("learner.ExportWeights", lambda: self.learner.ExportWeights.remote(req))

    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse:
        return await self.retrying.call("learner.SaveCheckpoint", lambda: self.learner.SaveCheckpoint.remote(req))

    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse:
        return await self.retrying.call("learner.LoadCheckpoint", lambda: self.learner.LoadCheckpoint.remote(req))

    async def release_learner(self, run_id: str) -> None:
        await self.retrying.call("learner.ReleaseSession", lambda: self.learner.ReleaseSession.remote(
            learner_pb2.ReleaseSessionRequest(run_id=run_id)))

    def agent_sessions(self) -> AgentSessions:
        if self.agents is None:
            return super().agent_sessions()
        return self.agents

    async def capacity(self) -> Capacity:
        total = ray.cluster_resources()
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]
        return Capacity(total.get("CPU", 0.0), total.get("GPU", 0.0), max(nodes, default=0.0))


class TinkerHandles:
    """The learner's and the rollout's RPCs the Tinker API calls (`rlserve.tinker.backends.LearnerCalls` and
    `RolloutCalls`), each once, without `Retrying`: a forward_backward retried after it ran would add its
    gradients twice (the SDK retries what may be retried). A failure raises the service's `RpcError`."""

    def __init__(self, apps: dict[str, str]):
        self.apps = apps
        self._handles: dict[str, DeploymentHandle] = {}

    async def _call(self, app: str, method: str, *args):
        if app not in self._handles:
            self._handles[app] = serve.get_app_handle(self.apps[app])
        try:
            return await getattr(self._handles[app], method).remote(*args)
        except Exception as err:  # noqa: BLE001 - whatever the handle raised, as the status it means
            raise status_of(err) from None

    async def configure(self, req: learner_pb2.ConfigureRequest, spec: RunSpec) -> learner_pb2.ConfigureResponse:
        return await self._call("learner", "Configure", req, spec)

    async def forward(self, req: learner_pb2.ForwardRequest) -> learner_pb2.ForwardResponse:
        return await self._call("learner", "Forward", req)

    async def optim_step(self, req: learner_pb2.OptimStepRequest) -> learner_pb2.OptimStepResponse:
        return await self._call("learner", "OptimStep", req)

    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse:
        return await self._call("learner", "SaveCheckpoint", req)

    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse:
        return await self._call("learner", "LoadCheckpoint", req)

    async def release_learner(self, run_id: str) -> None:
        await self._call("learner", "ReleaseSession", learner_pb2.ReleaseSessionRequest(run_id=run_id))

    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        return await self._call("rollout", "Generate", req)

    async def rollout_info(self) -> rollout_pb2.GetInfoResponse:
        return await self._call("rollout", "GetInfo", rollout_pb2.GetInfoRequest())
