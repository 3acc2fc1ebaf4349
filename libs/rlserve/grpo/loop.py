"""One attempt of a run's GRPO loop: set up, run producer and trainer under a watchdog, finish.

`recovery.run_grpo` runs attempts until the run ends. An attempt owns all
its state (`state.py`): a recovery builds a fresh one (empty queue, sampler
at the checkpoint's cursor) around the same run record and services.

    setup     restore the last checkpoint (resuming), or SFT warm start and
              configure the learner; publish the policy; validate at the start
    producer  generate -> score -> reference, step after step (`producer.py`)
    trainer   filter -> advantages -> train -> sync weights (`trainer.py`)
    finish    save the final policy and the plot; check the ledger balances

Any task's error ends the attempt; the watchdog fails a run that makes no
progress rather than let it hang silently.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod

from rlserve.data.dataset import PromptSampler
from rlserve.grpo.checkpoints import Checkpoints, step_dir
from rlserve.grpo.groups import StepQueue
from rlserve.grpo.producer import Producer
from rlserve.grpo.services import RunServices
from rlserve.grpo.sft import sft_warm_start
from rlserve.grpo.staleness import StalenessBound
from rlserve.grpo.state import LoopSettings, ProducerState, RunInputs, TrainerState
from rlserve.grpo.sync import WeightSync
from rlserve.grpo.trainer import Trainer
from rlserve.grpo.validation import Validator
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2


class Attempt(ABC):
    """One attempt of a run (GRPO's here, `algorithm: sft`/`dpo`'s in `rlserve.supervised`): its main task
    under a watchdog that fails a run making no progress rather than let it hang silently."""

    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, settings: LoopSettings,
                 recovering_since: float | None = None):
        self.inputs, self.run, self.services, self.settings = inputs, run, services, settings
        # When this attempt follows a loss of state: since when (monotonic), for the RECOVERED event.
        self.recovering_since = recovering_since
        self.last_progress = time.monotonic()
        self.trainer_state = TrainerState(init_model=inputs.model_path)

    @abstractmethod
    async def _main(self, resume_reason: str, tasks: list[asyncio.Task]) -> None:
        """Set up (or restore), train every step, finish; tasks it starts go into `tasks` (cancelled with it)."""

    def progress(self) -> None:
        self.last_progress = time.monotonic()

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
                                   f"{self.trainer_state.step}; {waiting}last event: "
                                   f"{self.run.events[-1].message if self.run.events else '-'}")


class GrpoAttempt(Attempt):
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, settings: LoopSettings,
                 recovering_since: float | None = None):
        super().__init__(inputs, run, services, settings, recovering_since)
        spec = inputs.spec
        self.producer_state = ProducerState(PromptSampler(list(inputs.train), spec.data.seed))
        learner_on_cpu = spec.cluster.device == "cpu" or (spec.cluster.device == "auto"
                                                         and spec.cluster.gpus_per_worker == 0)
        self.cores_shared = settings.generation_shares_cpu_cores and learner_on_cpu
        self.queue = StepQueue(StalenessBound(spec.grpo.max_age(self.cores_shared)))
        self.sync = WeightSync(inputs, run, services, settings.weight_store, self.progress)
        self.validator = Validator(inputs, run, services, self.trainer_state, self.progress)
        self.checkpoints = Checkpoints(inputs, run, services, self.producer_state, self.trainer_state, self.queue,
                                       self.progress)

    async def _main(self, resume_reason: str, tasks: list[asyncio.Task]) -> None:
        await self._setup(resume_reason)
        # The reference service scores with the policy the run started from, or a distillation's teacher.
        producer = Producer(self.inputs, self.run, self.services, self.producer_state, self.queue,
                            self.inputs.teacher_path or self.trainer_state.init_model, self.progress)
        trainer = Trainer(self.inputs, self.run, self.services, self.trainer_state, self.producer_state,
                          self.queue, self.sync, self.validator, self.checkpoints, self.progress)
        producing = asyncio.create_task(producer.run_steps())
        training = asyncio.create_task(trainer.run_steps())
        tasks += [producing, training]
        done, _ = await asyncio.wait({producing, training}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception():
                raise task.exception()
        await training
        await self._finish()

    async def _setup(self, resume_reason: str) -> None:
        """Restore the last checkpoint (resuming) or configure the learner (after an SFT warm start);
        publish the policy; validate at the start."""
        run, spec, inputs = self.run, self.inputs.spec, self.inputs
        if spec.grpo.async_grpo.enabled == "auto" and not resume_reason:
            run.emit(pb.EVENT_KIND_INFO, "async_grpo.enabled auto: " + (
                "sync, generation and training share the CPU cores" if self.cores_shared else
                f"async, max trajectory age {spec.grpo.max_age(self.cores_shared)}"))
        restored = bool(resume_reason) and await self.checkpoints.restore(resume_reason, self.recovering_since)
        if not restored:
            if resume_reason:
                self.checkpoints.start_over(resume_reason, self.recovering_since)
            if spec.sft.enabled:
                self.trainer_state.init_model = await sft_warm_start(inputs, run, self.services, self.sync,
                                                                     self.progress)
            info = await self.services.configure(learner_pb2.ConfigureRequest(
                run_id=run.run_id, spec_yaml=inputs.spec_yaml(), init_model_path=str(self.trainer_state.init_model),
                shared_base=spec.shares_deployed_base))
            run.emit(pb.EVENT_KIND_INFO, f"learner ready: {info.backend} backend, {info.parallel_layout}, "
                     f"{info.num_parameters / 1e6:.2f}M parameters on {info.device}")
        await self.sync.publish()
        if spec.grpo.val_at_start and not restored:
            run.recorder.metrics(0, await self.validator.validate(0))

    async def _finish(self) -> None:
        """Save the final policy and the plot; a run that trained nothing fails, one with skipped steps warns."""
        run, ledger = self.run, self.run.ledger
        final = run.run_dir / "final_model"
        await self.services.save_checkpoint(learner_pb2.SaveCheckpointRequest(
            run_id=run.run_id, path=str(step_dir(run.run_dir, run.step) / "learner"), hf_path=str(final)))
        run.final_model_path = str(final)
        if self.inputs.spec.logger.plot_enabled:
            plot = await asyncio.to_thread(run.recorder.plot)
            run.plot_path = str(plot) if plot else ""
        if not ledger.balanced():
            raise RuntimeError(f"ledger does not balance at the end: {ledger.to_dict()}")
        if ledger.trained == 0:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(ledger.dropped.items()))
            raise RuntimeError(f"the run trained nothing: all {ledger.generated} trajectories were dropped "
                               f"({reasons}); {final} is the initial policy")
        skipped = [r["step"] for r in run.recorder.read("metrics.jsonl") if r.get("batch/groups_trained") == 0.0]
        if skipped:
            run.emit(pb.EVENT_KIND_WARNING, f"{len(skipped)} of {run.step} steps trained nothing (steps "
                     f"{', '.join(map(str, skipped[:20]))}{', ...' if len(skipped) > 20 else ''}); see their "
                     f"WARNING and DROPPED events")
        summary = f"final policy in {final}"
        if "val/reward" in run.last_metrics and self.trainer_state.initial_val is not None:
            summary += (f"; held-out reward: before {self.trainer_state.initial_val:.2f} after "
                        f"{run.last_metrics['val/reward']:.2f}")
        run.emit(pb.EVENT_KIND_INFO, summary)
