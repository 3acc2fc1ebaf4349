"""Tinker models as runs of the coordinator's run manager (`ModelRuns` over `rlserve.runs.manager`): each model
is a run of kind "tinker", owned by its user, queued under the cluster's `tenancy` (the user's quota, the runs
that train at once, fair share on the learner and engines by its priority), cancelled by `rlserve runs cancel`
like any run, and metered: every optim_step is a STEP event carrying what the model's calls since the last one
spent (`usage/*`: `rlserve runs usage` sums them), and what it spends otherwise (sampling) an INFO event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rlserve.config import RunSpec
from rlserve.runs.manager import RunManager
from rlserve.security.principal import SYSTEM, Principal
from rlserve.tinker.backends import WaitReason
from rlserve.v1 import coordinator_pb2 as pb

KIND = "tinker"


class ManagerRuns:
    def __init__(self, manager: RunManager):
        self.manager = manager

    async def open(self, caller: Principal, run_id: str, spec: RunSpec, body: Callable[[], Awaitable[None]],
                   waiting: Callable[[WaitReason, str], None]) -> None:
        async def run_body(run) -> None:
            await body()

        await self.manager.open_run(caller, spec, run_id, KIND, run_body, waiting)

    def meter(self, run_id: str, usage: dict[str, float], version: int | None) -> None:
        run = self.manager.get(run_id, SYSTEM)
        if version is not None:
            run.record_primitive_step(version, usage)
        elif usage:
            run.emit(pb.EVENT_KIND_INFO, "calls' spend", usage)
