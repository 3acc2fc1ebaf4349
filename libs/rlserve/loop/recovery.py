"""A run heals itself: when a service loses the run's state, continue from the last checkpoint.

`run_to_end` runs attempts of the loop (`attempt.Attempt`, whatever the run's algorithm). An attempt that
ends with `RunStateLost` (a service answered ABORTED: the learner's training
session is gone because a worker died or its replica restarted, or the
rollout no longer holds the run's weights) is followed by another that
reconfigures the learner from the last checkpoint, drops what was generated
after it with reason `recovered`, and goes on; a RECOVERED event says what
was lost and how many steps are redone. The number of recoveries in a row
without a new checkpoint in between is bounded
(`checkpointing.max_recovery_attempts`), so a fault that recurs every time
fails the run instead of looping. `checkpointing.auto_resume: false` turns
this off (the run then fails, and `rlserve submit --resume` continues it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from rlserve.logs import event
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.attempt import Attempt
from rlserve.loop.inputs import LoopSettings, RunInputs
from rlserve.loop.services import RunServices, RunStateLost, ServiceFailure
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb

log = logging.getLogger("rlserve.coordinator")


@dataclass
class RecoveryBudget:
    """Recoveries allowed in a row; a new checkpoint (progress that sticks) refills it."""

    max_attempts: int
    used: int = 0

    def spend(self) -> bool:
        if self.used >= self.max_attempts:
            return False
        self.used += 1
        return True

    def refill(self) -> None:
        self.used = 0


async def run_to_end(run: Run, services: RunServices, settings: LoopSettings) -> None:
    """Run `run` to its end (raises on failure); `services` is closed afterwards."""
    cfg = run.spec.checkpointing
    budget = RecoveryBudget(cfg.max_recovery_attempts)
    reason = run.take_resume_reason()
    since: float | None = None
    try:
        while True:
            # Off the event loop: building the data set takes a while, and the coordinator keeps answering.
            algorithm = algorithm_class(run.spec)
            inputs = await asyncio.to_thread(RunInputs.build, run.run_id, run.spec, run.run_dir, algorithm.data)
            attempt = Attempt(algorithm, inputs, run, services, settings, recovering_since=since)
            try:
                await attempt.run_attempt(reason)
                return
            except RunStateLost as err:
                if attempt.state.checkpoints_saved:
                    budget.refill()
                if not cfg.auto_resume:
                    raise RuntimeError(f"{err} (checkpointing.auto_resume is off; continue with "
                                       f"`rlserve submit --resume {run.run_id}`)") from None
                if not budget.spend():
                    raise RuntimeError(f"{err}; gave up after {budget.max_attempts} recoveries in a row without a "
                                       f"new checkpoint (checkpointing.max_recovery_attempts)") from None
                since = time.monotonic()
                reason = f"recovery {budget.used}/{budget.max_attempts} after lost state ({err})"
                run.emit(pb.EVENT_KIND_INFO, f"the run lost state at step {run.step}: {err}; restoring the last "
                         f"checkpoint (recovery {budget.used}/{budget.max_attempts})")
    finally:
        try:
            await asyncio.shield(services.release_learner(run.run_id))  # its workers hold CPUs and GPUs
        except ServiceFailure as err:
            event(log, "run.learner_not_released", logging.WARNING, run=run.run_id, error=str(err)[:300])
        await services.close()
