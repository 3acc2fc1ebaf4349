"""The services a run talks to, as one typed protocol.

The loop reaches the rollout, reward (and environment), reference and learner services only
through `RunServices`. The coordinator implements it with Serve handles
(`services/coordinator/handles.py`: retries, the object store for the
training batch); unit tests implement it in memory (`tests/support/
fake_services.py`). Requests and responses are the services' own proto
messages, the contract of `protos/rlserve/v1`.

A call that fails for good raises `ServiceFailure`; `RunStateLost` means a
service no longer holds the run's state (the learner's session, the
rollout's weights), which only a restore from the last checkpoint can mend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from rlserve.agents.table import AgentSessions
from rlserve.config import RunSpec
from rlserve.training.batch import TrainBatch
from rlserve.v1 import environment_pb2, learner_pb2, reference_pb2, reward_pb2, rollout_pb2


class ServiceFailure(Exception):
    """A service call failed for good (after retries, or with a status no retry can change)."""


class RunStateLost(ServiceFailure):
    """A service no longer holds the run's state (ABORTED); the run continues only from a checkpoint."""


@dataclass(frozen=True)
class Capacity:
    cpus: float  # logical CPUs of the whole cluster
    gpus: float
    node_cpus: float  # the most logical CPUs one node has (a worker's threads run on one node)


class RunServices(ABC):
    # --- rollout -------------------------------------------------------------------
    @abstractmethod
    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse: ...

    @abstractmethod
    async def update_weights(self, req: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse: ...

    @abstractmethod
    async def rollout_info(self) -> rollout_pb2.GetInfoResponse: ...

    # --- reward and reference -------------------------------------------------------
    @abstractmethod
    async def score(self, req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse: ...

    # --- environments (the reward application, or the run's env.endpoint) ---------------------
    @abstractmethod
    async def env_reset(self, req: environment_pb2.ResetRequest) -> environment_pb2.ResetResponse: ...

    @abstractmethod
    async def env_step(self, req: environment_pb2.StepRequest) -> environment_pb2.StepResponse: ...

    @abstractmethod
    async def reference_logprobs(self, req: reference_pb2.LogProbsRequest) -> reference_pb2.LogProbsResponse: ...

    # --- learner -------------------------------------------------------------------------
    @abstractmethod
    async def configure(self, req: learner_pb2.ConfigureRequest, spec: RunSpec) -> learner_pb2.ConfigureResponse:
        """A training session configured by `spec`, the run's resolved spec itself (the implementation decides
        how it travels; `req.spec_yaml` may be empty)."""

    @abstractmethod
    async def train_step(self, req: learner_pb2.TrainStepRequest, batch: TrainBatch) -> learner_pb2.TrainStepResponse:
        """One optimizer step on `batch` (the implementation decides how the batch travels)."""

    @abstractmethod
    async def export_weights(self, req: learner_pb2.ExportWeightsRequest) -> learner_pb2.ExportWeightsResponse: ...

    @abstractmethod
    async def save_checkpoint(self, req: learner_pb2.SaveCheckpointRequest) -> learner_pb2.SaveCheckpointResponse: ...

    @abstractmethod
    async def load_checkpoint(self, req: learner_pb2.LoadCheckpointRequest) -> learner_pb2.LoadCheckpointResponse: ...

    @abstractmethod
    async def release_learner(self, run_id: str) -> None:
        """End the run's training session (its workers' CPUs and GPUs go back to the cluster)."""

    # --- the cluster -----------------------------------------------------------------------
    @abstractmethod
    async def capacity(self) -> Capacity:
        """What the cluster has for learner workers."""

    # --- external agents ----------------------------------------------------------------
    def agent_sessions(self) -> AgentSessions:
        """Where an external_agent run's session meets the agent endpoint (`rlserve.agents`): the coordinator's
        table, which its Agents RPCs read too."""
        raise ServiceFailure("these services serve no agent endpoint (env.name: external_agent)")

    # --- bookkeeping ---------------------------------------------------------------------
    def oldest_pending(self) -> tuple[str, float] | None:
        """The longest-running call in progress (what, seconds), for the watchdog's message."""
        return None

    async def close(self) -> None:
        """Release what the implementation holds (channels to external servers)."""
