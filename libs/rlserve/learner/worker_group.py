"""How the learner's policy reaches its ranks: one small protocol, whatever runs the workers.

A `WorkerGroup` is one `WorkerHost` per rank forming one torch.distributed
group. The session table (`rlserve.learner.sessions`) decides what to call
and what a death means; a group only dispatches (`call_all`: the same method
on every rank, answers in rank order), replaces its workers (`restart`) and
ends them (`close`), as vLLM's executors (`collective_rpc`) and verl's
`WorkerGroup` separate dispatch from the engine. Implementations:
`rlserve.learner.ray_group` (Ray actors in a placement group, the cluster's)
and `rlserve.learner.in_process_group` (one rank in this process, for unit
tests). Failures reach the policy as the errors below, or as what the worker's
method raised.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:
    from rlserve.config import RunSpec
    from rlserve.learner.worker_host import WorkerHost

P = ParamSpec("P")
T = TypeVar("T")


class WorkerDied(Exception):
    """A worker of the group is gone (killed, crashed, its node lost), and with it every run's state in the
    group: the group is unusable until `restart`. `reason` says how, in a word or two."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NoRoom(Exception):
    """The workers' resources did not come in time (the cluster is full)."""


@dataclass(frozen=True)
class WorkerLayout:
    """The workers a run's learner needs (its `cluster` section); runs sharing a base share a group only
    when their layouts are equal."""

    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    device: str
    torch_threads: int

    @classmethod
    def of(cls, spec: RunSpec) -> WorkerLayout:
        cl = spec.cluster
        return cls(cl.num_workers, cl.cpus_per_worker, cl.gpus_per_worker, cl.device, cl.torch_threads)


class WorkerGroup(ABC):
    """One `WorkerHost` per rank of `layout`; the session table is its only caller (one call at a time)."""

    layout: WorkerLayout

    @abstractmethod
    async def call_all(self, method: Callable[Concatenate[WorkerHost, P], T], *args: P.args,
                       **kwargs: P.kwargs) -> list[T]:
        """`method` (a `WorkerHost` method) on every rank with the same arguments; the answers in rank order.
        Raises WorkerDied when a worker dies, else what a rank's method raised."""

    @abstractmethod
    async def restart(self) -> None:
        """New workers of the same layout in place of the group's (whatever state they held is gone): raises
        NoRoom or WorkerDied when they cannot start."""

    @abstractmethod
    def close(self) -> None:
        """End the workers and free their resources (again: nothing happens)."""


# Starts a group of a layout (raises NoRoom when its resources do not come in time).
StartGroup = Callable[[WorkerLayout], Awaitable[WorkerGroup]]
