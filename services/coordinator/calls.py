"""Typed calls to the other services, with retries, back-off and time-outs.

Every call goes through `ServiceCalls.call`: errors that may pass (a replica
restarting, a service redeploying, a time-out) are retried with exponential
back-off, each retry announced as a RETRY event; an error that will not pass
(INVALID_ARGUMENT, NOT_FOUND, ...) or a service that stays down ends the run
with a clear message. ABORTED means a service lost state the run relies on
(the learner's training session): no retry of that call can help, so it is
raised at once as `RunStateLost`, which the loop answers by restoring the
last checkpoint (`recovery.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.exceptions import RayServeException

from rlserve.rpc import status_of
from rlserve.v1 import learner_pb2, reference_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2

T = TypeVar("T")
_FINAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS,
          grpc.StatusCode.UNIMPLEMENTED}


class ServiceFailure(Exception):
    """A service call failed for good (after retries, or with a non-retryable status)."""


class RunStateLost(ServiceFailure):
    """A service no longer holds the run's state (ABORTED); the run continues only from a checkpoint."""


class RetryPolicy(BaseModel):
    """How calls to the other services are retried (the coordinator's `retry` arg in the cluster file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retries: int = Field(5, ge=0)
    first_backoff_s: float = Field(1.0, gt=0)
    max_backoff_s: float = Field(16.0, gt=0)
    # Per attempt.
    timeout_s: float = Field(900.0, gt=0)


class ServiceCalls:
    def __init__(self, apps: dict[str, str], reward_endpoint: str | None, policy: RetryPolicy,
                 on_retry: Callable[[str], None]):
        self.rollout = serve.get_app_handle(apps["rollout"])
        self.reward = serve.get_app_handle(apps["reward"])
        self.reference = serve.get_app_handle(apps["reference"])
        self.learner = serve.get_app_handle(apps["learner"])
        self.policy = policy
        self.on_retry = on_retry
        self._reward_channel = grpc.aio.insecure_channel(reward_endpoint) if reward_endpoint else None
        self._reward_stub = reward_pb2_grpc.RewardStub(self._reward_channel) if reward_endpoint else None
        self.pending: dict[int, tuple[str, float]] = {}  # calls in progress: what, since (monotonic)
        self._ids = itertools.count()

    def oldest_pending(self) -> tuple[str, float] | None:
        """The longest-running call in progress (what, seconds), for the watchdog's message."""
        if not self.pending:
            return None
        what, since = min(self.pending.values(), key=lambda p: p[1])
        return what, time.monotonic() - since

    async def close(self) -> None:
        if self._reward_channel is not None:
            await self._reward_channel.close()

    async def call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        key = next(self._ids)
        self.pending[key] = (what, time.monotonic())
        try:
            return await self._call(what, make)
        finally:
            del self.pending[key]

    async def _call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        delay = self.policy.first_backoff_s
        for attempt in range(self.policy.retries + 1):
            try:
                return await asyncio.wait_for(make(), self.policy.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - classified below
                status = status_of(err)
                code, message = status.code, status.message
                if code == grpc.StatusCode.ABORTED:
                    raise RunStateLost(f"{what}: {code.name}: {message}") from None
                if code in _FINAL:
                    raise ServiceFailure(f"{what}: {code.name}: {message}") from None
                if attempt == self.policy.retries:
                    raise ServiceFailure(f"{what} still failing after {self.policy.retries} retries: "
                                         f"{code.name}: {message}") from None
                self.on_retry(f"{what} failed ({code.name}: {message[:200]}); retry {attempt + 1}/"
                              f"{self.policy.retries} in {delay:.0f}s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.policy.max_backoff_s)
        raise AssertionError("unreachable")

    # --- typed calls -------------------------------------------------------

    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        return await self.call("rollout.Generate", lambda: self.rollout.Generate.remote(req))

    async def update_weights(self, req: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        return await self.call("rollout.UpdateWeights", lambda: self.rollout.UpdateWeights.remote(req))

    async def rollout_info(self) -> rollout_pb2.GetInfoResponse:
        return await self.call("rollout.GetInfo", lambda: self.rollout.GetInfo.remote(rollout_pb2.GetInfoRequest()))

    async def score(self, req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        if self._reward_stub is not None:
            return await self.call("reward.Score", lambda: self._reward_stub.Score(req))
        return await self.call("reward.Score", lambda: self.reward.Score.remote(req))

    async def logprobs(self, req: reference_pb2.LogProbsRequest) -> reference_pb2.LogProbsResponse:
        return await self.call("reference.LogProbs", lambda: self.reference.LogProbs.remote(req))

    async def configure(self, req: learner_pb2.ConfigureRequest) -> learner_pb2.ConfigureResponse:
        return await self.call("learner.Configure", lambda: self.learner.Configure.remote(req))

    async def train_step(self, req: learner_pb2.TrainStepRequest, batch_ref: Any) -> learner_pb2.TrainStepResponse:
        return await self.call("learner.TrainStep", lambda: self.learner.TrainStep.remote(req, [batch_ref]))

    async def export_weights(self, req: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse:
        return await self.call("learner.ExportWeights", lambda: self.learner.ExportWeights.remote(req))

    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse:
        return await self.call("learner.SaveCheckpoint", lambda: self.learner.SaveCheckpoint.remote(req))

    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse:
        return await self.call("learner.LoadCheckpoint", lambda: self.learner.LoadCheckpoint.remote(req))


async def connect_services(apps: dict[str, str], reward_endpoint: str | None, policy: RetryPolicy,
                           on_retry: Callable[[str], None], timeout_s: float) -> ServiceCalls:
    """ServiceCalls once every application exists: a coordinator that resumes runs as it starts comes
    up beside the other applications, not after them."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ServiceCalls(apps, reward_endpoint, policy, on_retry)
        except RayServeException as err:
            if time.monotonic() > deadline:
                raise ServiceFailure(f"the services are not deployed after {timeout_s:.0f}s: {err}") from None
            await asyncio.sleep(2.0)
