"""One attempt of a run, for any algorithm: setup -> steps (each with its epilogue) -> finish, under a
watchdog.

    setup      restore the last checkpoint (resuming), or let the algorithm prepare (an RL run's SFT warm
               start) and configure the learner; publish the policy where it is sampled from or
               validated; validate at the start (the run's baseline)
    step       the algorithm's (`rlserve.algorithms.*`); work it runs beside the steps (an RL run's
               producer) fails the attempt with it
    epilogue   validation when due, the consistency guard (`consistency.py`: the generator's logprobs against
               the learner's, `loss_fn.mismatch_guard`), the step recorded (metrics, ledger, STEP event), a
               checkpoint every `checkpointing.save_period` steps (and before a pause the guard asks for),
               a stop when the algorithm asks for one
    finish     save the final policy and the plot; check that the ledger balances and something trained

`recovery.run_to_end` runs attempts until the run ends; an attempt owns all its state (a recovery
builds a fresh one around the same run record and services). The watchdog fails a run that makes no
progress rather than let it hang silently.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rlserve.loop.algorithm import Algorithm
from rlserve.loop.checkpoints import Checkpoints, step_dir
from rlserve.loop.consistency import ConsistencyGuard
from rlserve.loop.inputs import LoopSettings, RunInputs
from rlserve.loop.learner import configure_learner
from rlserve.loop.services import RunServices
from rlserve.loop.state import LoopState
from rlserve.loop.sync import WeightSync
from rlserve.loop.validation import Validator
from rlserve.runs.consistency import summary as consistency_summary
from rlserve.runs.record import Run, RunPaused
from rlserve.training.batch import TrainBatch
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2


class Attempt:
    def __init__(self, algorithm: type[Algorithm], inputs: RunInputs, run: Run, services: RunServices,
                 settings: LoopSettings, recovering_since: float | None = None):
        self.inputs, self.run, self.services, self.settings = inputs, run, services, settings
        # When this attempt follows a loss of state: since when (monotonic), for the RECOVERED event.
        self.recovering_since = recovering_since
        self.last_progress = time.monotonic()
        self.state = LoopState(init_model=inputs.model_path)
        self.sync = WeightSync(inputs, run, services, settings.weight_store, self.progress)
        self.validator = Validator(inputs, run, services, self.state, self.progress)
        self.checkpoints = Checkpoints(inputs, run, services, self.state, self.progress)
        self.algorithm = algorithm(self)

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    async def train(self, batch: TrainBatch, loss_name: str, learning_rate: float | None = None
                    ) -> learner_pb2.TrainStepResponse:
        """One optimizer step of the run's learner session on `batch` (a retried call never trains twice: it
        names the version it expects)."""
        req = learner_pb2.TrainStepRequest(run_id=self.run.run_id, loss_name=loss_name,
                                           expected_weight_version=self.state.version)
        if learning_rate is not None:
            req.learning_rate = learning_rate
        result = await self.services.train_step(req, batch)
        self.state.version = result.weight_version
        return result

    async def run_attempt(self, resume_reason: str) -> None:
        """Set up (or restore), run the steps under the watchdog, finish."""
        tasks: list[asyncio.Task] = []
        try:
            dog = asyncio.create_task(self._watchdog())
            main = asyncio.create_task(self._main(resume_reason, tasks))
            tasks += [dog, main]
            done, _ = await asyncio.wait({dog, main}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _main(self, resume_reason: str, tasks: list[asyncio.Task]) -> None:
        await self._setup(resume_reason)
        beside = [asyncio.create_task(work) for work in await self.algorithm.background()]
        steps = asyncio.create_task(self._steps())
        tasks += [*beside, steps]
        done, _ = await asyncio.wait({steps, *beside}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception():
                raise task.exception()
        await steps
        await self._finish()

    async def _setup(self, resume_reason: str) -> None:
        run, algorithm = self.run, self.algorithm
        restored = bool(resume_reason) and await self.checkpoints.restore(resume_reason, self.recovering_since,
                                                                          algorithm)
        if not restored:
            if resume_reason:
                self.checkpoints.start_over(resume_reason, self.recovering_since)
            self.state.init_model = await algorithm.prepare()
            info = await configure_learner(self.services, self.inputs, self.state.init_model)
            self.state.version = 0
            run.emit(pb.EVENT_KIND_INFO, f"learner ready for {self.inputs.spec.algorithm}: {info.backend} backend, "
                     f"{info.parallel_layout}, {info.num_parameters / 1e6:.2f}M parameters on {info.device}")
            if algorithm.samples_from_policy:
                for warning in self.inputs.spec.loss_fn.warnings():
                    run.emit(pb.EVENT_KIND_WARNING, warning)
        baseline = not restored and algorithm.validates_at_start()
        if algorithm.samples_from_policy or baseline:
            await self.sync.publish()
        if baseline:
            run.recorder.metrics(0, await self.validator.validate(0))

    async def _steps(self) -> None:
        """Every step up to the algorithm's max_num_steps, each followed by its epilogue."""
        run, algorithm, state, spec = self.run, self.algorithm, self.state, self.inputs.spec
        guard = ConsistencyGuard(spec, [r for r in run.recorder.read("metrics.jsonl") if 0 < r["step"] <= state.step])
        for step in range(state.step, algorithm.max_steps):
            metrics = await algorithm.step(step)
            done = step + 1
            last = done == algorithm.max_steps
            if algorithm.validation_due(done):
                await self.sync.ensure_published(state.version)
                metrics.update(await self.validator.validate(done))
            crossing = guard.check(done, metrics)
            state.step = done
            algorithm.after_step(done, state.version)
            # Counted as trained only with the STEP event that announces them: a fault before this point
            # (weight sync, validation) leaves them in flight, and the rewind drops them as `recovered`.
            run.record_step(done, state.version, metrics)
            self.progress()
            if crossing is not None:
                run.emit(pb.EVENT_KIND_WARNING, crossing.message)
            stop = algorithm.stop_reason(metrics)
            pause = crossing is not None and crossing.action == "pause" and not (last or stop)
            if spec.checkpointing.enabled and (pause or done % spec.checkpointing.save_period == 0) and not (
                    last or stop):
                await self.checkpoints.save(done, algorithm)
            run.save()
            if crossing is not None and crossing.action == "fail":
                raise RuntimeError(f"loss_fn.mismatch_guard: {crossing.message}")
            if pause:
                raise RunPaused(f"loss_fn.mismatch_guard: {crossing.message}")
            if stop:
                run.emit(pb.EVENT_KIND_INFO, f"{stop} at step {done}; stopping")
                return

    async def _finish(self) -> None:
        """Save the final policy and the plot; a run that trained nothing fails, one with skipped steps warns."""
        run, ledger, unit = self.run, self.run.ledger, self.algorithm.unit
        final = run.run_dir / "final_model"
        await self.services.save_checkpoint(learner_pb2.SaveCheckpointRequest(
            run_id=run.run_id, path=str(step_dir(run.run_dir, run.step) / "learner"), hf_path=str(final)))
        plot = await asyncio.to_thread(run.recorder.plot) if self.inputs.spec.logger.plot_enabled else None
        run.finish(str(final), str(plot) if plot else "")
        if not ledger.balanced():
            raise RuntimeError(f"ledger does not balance at the end: {ledger.to_dict()}")
        if ledger.trained == 0:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(ledger.dropped.items()))
            raise RuntimeError(f"the run trained nothing: all {ledger.generated} {unit} were dropped ({reasons}); "
                               f"{final} is the initial policy")
        rows = run.recorder.read("metrics.jsonl")
        skipped = [r["step"] for r in rows if r.get("batch/trajectories_trained", 1.0) == 0.0]
        if skipped:
            run.emit(pb.EVENT_KIND_WARNING, f"{len(skipped)} of {run.step} steps trained nothing (steps "
                     f"{', '.join(map(str, skipped[:20]))}{', ...' if len(skipped) > 20 else ''}); see their "
                     f"WARNING and DROPPED events")
        run.emit(pb.EVENT_KIND_INFO, self._summary(final, rows))

    def _summary(self, final: Path, rows: list[dict]) -> str:
        """The final INFO event: where the policy is, and what the run changed."""
        last = self.run.last_metrics
        losses = [r["loss/total"] for r in rows if "loss/total" in r]
        summary = f"final policy in {final}"
        if losses:
            summary += f"; training loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        if "dpo/accuracy" in last:
            summary += f", preference accuracy {last['dpo/accuracy']:.2f}"
        if "val/reward" in last and self.state.initial_val is not None:
            summary += f"; held-out reward: before {self.state.initial_val:.2f} after {last['val/reward']:.2f}"
        consistency = consistency_summary(last)
        return summary + (f"; {consistency}" if consistency else "")

    async def _watchdog(self) -> None:
        """Fail a run that makes no progress, rather than let it hang silently."""
        limit = self.settings.watchdog_timeout_s
        while True:
            await asyncio.sleep(min(10.0, limit / 4))
            idle = time.monotonic() - self.last_progress
            if idle > limit:
                pending = self.services.oldest_pending()
                waiting = f"waiting on {pending[0]} for {pending[1]:.0f}s; " if pending else ""
                raise RuntimeError(f"watchdog: no progress for {idle:.0f}s (limit {limit:.0f}s) at step "
                                   f"{self.state.step}; {waiting}last event: "
                                   f"{self.run.events[-1].message if self.run.events else '-'}")
