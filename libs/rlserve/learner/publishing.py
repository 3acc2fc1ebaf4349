"""Where a learner rank sends a run's weight versions, as a contract without Ray.

A `WorkerHost` (`rlserve.learner.worker_host`) exports through `Publishing`;
inside the cluster that is `rlserve.learner.publisher.StorePublishing` (the
weight store and the fleet of rollout replicas, over Ray), and a unit test
passes one that keeps what it was given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlserve.learner.interfaces import LearnerBackend


@dataclass(frozen=True)
class Published:
    """What one publication did (rank 0's; the other ranks only join the export's gathers)."""

    version: int
    num_buckets: int
    num_tensors: int
    num_bytes: int  # one copy of what was exported (the model, or with LoRA the adapter) in the export dtype
    model_bytes: int  # the whole model in the export dtype: what a full-parameter update sends
    seconds: float
    direct_seconds: float  # of `seconds`, the direct transfer to the engines (its share of the export walk too)
    # Of `seconds`, the weight store's copy on the step's path: to host memory and into the object store, or
    # after a same-device handoff to host memory only (the put follows in the background).
    store_seconds: float
    direct_bytes: int  # bytes sent to engines (all of them together; 0: store only)
    receivers: int  # replicas the version was sent to directly
    # Receivers (or "all") that dropped out of the direct transfer -> why; they catch up from the store.
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def failures(self) -> list[str]:
        """`failed` as "receiver: why" lines."""
        return [f"{who}: {why}" for who, why in self.failed.items()]


class WeightPublisher(Protocol):
    """One run's weight sync from rank 0; it keeps what it learned (the transfer group) between versions."""

    def publish(self, run_id: str, dtype: torch.dtype | None, in_flight: bool, direct: bool,
                shared_base: bool) -> Published: ...


class Publishing(ABC):
    """Where a learner rank's runs publish their weights."""

    @abstractmethod
    def publisher(self, backend: LearnerBackend, store_name: str, bucket_bytes: int,
                  timeout_s: float) -> WeightPublisher:
        """A publisher of `backend`'s versions into weight store `store_name` (made once per run, on rank 0)."""

    @abstractmethod
    def drop_adapter(self, store_name: str, run_id: str) -> None:
        """Take a released run's adapter out of the store (a run on the shared base published it there)."""
