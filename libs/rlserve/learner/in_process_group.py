"""A `WorkerGroup` of one rank in this process, so that a unit test drives the learner's policy (heal,
snapshot, restore) over real backends without Ray.

The rank is this process's torch.distributed group of world size 1 (gloo on
CPU), set up by the first group and shared by every later one: a group here
holds no process of its own, only its `WorkerHost`. A test stands in for a
crash with `kill` (the host and every run's state in it go; calls raise
WorkerDied until `restart`) or `kill_during` (a method's next calls run, then
the worker dies before answering, as a rank killed mid-call would).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate

from rlserve.learner.publishing import Publishing
from rlserve.learner.worker_group import P, StartGroup, T, WorkerDied, WorkerGroup, WorkerLayout
from rlserve.learner.worker_host import WorkerHost
from rlserve.training.distributed import device_for, init_process_group


@dataclass
class _Death:
    method: Callable
    run_id: str | None  # None: whichever run calls it
    times: int


class InProcessWorkerGroup(WorkerGroup):
    def __init__(self, layout: WorkerLayout, publishing: Publishing):
        if layout.num_workers != 1:
            raise ValueError(f"an in-process worker group has one rank; cluster.num_workers is {layout.num_workers}")
        self.layout, self.publishing = layout, publishing
        self.device = device_for(layout.device, local_rank=0)
        init_process_group(0, 1, f"file://{tempfile.mktemp(prefix='rlserve-rendezvous-')}", self.device)
        self.host: WorkerHost | None = WorkerHost(0, self.device, publishing)
        self.restarts = 0
        self._deaths: list[_Death] = []

    @staticmethod
    def starter(publishing: Publishing) -> StartGroup:
        """Starts groups of this kind (what the session table is given to start its groups with)."""
        async def start(layout: WorkerLayout) -> WorkerGroup:
            return InProcessWorkerGroup(layout, publishing)
        return start

    def kill(self) -> None:
        """The worker dies now: its runs' state goes, and every call raises WorkerDied until `restart`."""
        self.host = None

    def kill_during(self, method: Callable, run_id: str | None = None, times: int = 1) -> None:
        """The next `times` calls of `method` (of `run_id`'s only, when given) run, then the worker dies
        before it answers."""
        self._deaths.append(_Death(method, run_id, times))

    def _dies_after(self, method: Callable, args: tuple) -> bool:
        for death in self._deaths:
            if death.method == method and death.run_id in (None, args[0] if args else None):
                death.times -= 1
                if not death.times:
                    self._deaths.remove(death)
                return True
        return False

    async def call_all(self, method: Callable[Concatenate[WorkerHost, P], T], *args: P.args,
                       **kwargs: P.kwargs) -> list[T]:
        if self.host is None:
            raise WorkerDied("killed")
        result = method(self.host, *args, **kwargs)
        if self._dies_after(method, args):
            self.kill()
            raise WorkerDied("killed")
        return [result]

    async def restart(self) -> None:
        self.host = WorkerHost(0, self.device, self.publishing)
        self.restarts += 1

    def close(self) -> None:
        self.host = None
