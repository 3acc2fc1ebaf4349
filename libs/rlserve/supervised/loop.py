"""One attempt of an `algorithm: sft` or `algorithm: dpo` run, read top to bottom.

    setup     restore the last checkpoint (resuming), or configure the learner on policy.model_name;
              SFT publishes the policy and validates at the start
    step      the next `batch_size` examples (DPO: pairs) at the data cursor -> a TrainBatch
              (`batches.py`) -> learner TrainStep with loss `sft` or `dpo` at the section's constant
              lr; SFT publishes and validates the held-out reward every `sft.val_period` steps and
              stops early at `sft.stop_at_val_reward`
    finish    save the final policy (final_model/, the HF folder `rlserve export` reads) and the plot;
              check the ledger balances

The run record is GRPO's: the ledger counts examples (pairs) as GRPO counts trajectories
(generated when taken, trained with the STEP event, dropped as `too_long` when nothing within
policy.max_total_sequence_length is left to train), checkpoints hold the learner's state and the
data cursor, and a lost learner session is mended from the last one (`rlserve.grpo.recovery`).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time

from rlserve.data.dataset import PromptSampler
from rlserve.grpo.checkpoints import commit_state, latest, rewind, step_dir
from rlserve.grpo.loop import Attempt
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import LoopSettings, RunInputs
from rlserve.grpo.sync import WeightSync
from rlserve.grpo.validation import Validator
from rlserve.runs.ledger import Ledger
from rlserve.runs.record import Run
from rlserve.supervised.batches import SupervisedBatch, dpo_batch, sft_batch
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2

TOO_LONG = "too_long"


class SupervisedAttempt(Attempt):
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, settings: LoopSettings,
                 recovering_since: float | None = None):
        super().__init__(inputs, run, services, settings, recovering_since)
        spec = inputs.spec
        self.sft = spec.algorithm == "sft"
        self.cfg = spec.sft if self.sft else spec.dpo
        self.sampler = PromptSampler(list(inputs.train) if self.sft else list(inputs.pairs.train), spec.data.seed)
        self.sync = WeightSync(inputs, run, services, settings.weight_store, self.progress)
        self.validator = Validator(inputs, run, services, self.trainer_state, self.progress)

    async def _main(self, resume_reason: str, tasks: list[asyncio.Task]) -> None:
        run, state, cfg = self.run, self.trainer_state, self.cfg
        await self._setup(resume_reason)
        for step in range(state.step, cfg.max_num_steps):
            metrics = await self._step(step)
            last = step + 1 == cfg.max_num_steps
            if self.sft and self.inputs.val and ((step + 1) % cfg.val_period == 0 or last):
                await self.sync.publish()
                metrics.update(await self.validator.validate(step + 1))
            run.step = state.step = step + 1
            run.last_metrics = {k: v for k, v in metrics.items() if isinstance(v, float)}
            run.recorder.metrics(step + 1, metrics)
            run.ledger.train(int(metrics["batch/trajectories_trained"]))
            run.emit(pb.EVENT_KIND_STEP, f"step {step + 1}/{cfg.max_num_steps}", metrics)
            self.progress()
            stop = self.sft and cfg.stop_at_val_reward is not None and metrics.get("val/reward", -math.inf) >= \
                cfg.stop_at_val_reward
            if self.inputs.spec.checkpointing.enabled and (step + 1) % self.inputs.spec.checkpointing.save_period == 0 \
                    and not (last or stop):
                await self._save(step + 1)
            run.save()
            if stop:
                run.emit(pb.EVENT_KIND_INFO, f"held-out reward {metrics['val/reward']:.3f} reached "
                         f"sft.stop_at_val_reward ({cfg.stop_at_val_reward}) at step {step + 1}; stopping")
                break
        await self._finish()

    async def _setup(self, resume_reason: str) -> None:
        run, inputs = self.run, self.inputs
        restored = bool(resume_reason) and await self._restore(resume_reason)
        if not restored:
            if resume_reason:
                rewind(run, resume_reason, "no complete checkpoint: started over from the initial policy", Ledger(),
                       0, 0, self.recovering_since or time.monotonic(), -1, self.progress)
            info = await self.services.configure(learner_pb2.ConfigureRequest(
                run_id=run.run_id, spec_yaml=inputs.spec_yaml(), init_model_path=str(inputs.model_path)))
            run.emit(pb.EVENT_KIND_INFO, f"learner ready for {inputs.spec.algorithm}: {info.backend} backend, "
                     f"{info.parallel_layout}, {info.num_parameters / 1e6:.2f}M parameters on {info.device}")
        if self.sft and inputs.val and not restored:
            await self.sync.publish()
            run.recorder.metrics(0, await self.validator.validate(0))

    async def _step(self, step: int) -> dict[str, float]:
        """Take the next examples, build the batch, train one update on it."""
        run, inputs, cfg = self.run, self.inputs, self.cfg
        t0 = time.perf_counter()
        first = self.sampler.position
        items = self.sampler.take(cfg.batch_size)
        max_len = inputs.spec.policy.max_total_sequence_length
        if self.sft:
            built: SupervisedBatch = await asyncio.to_thread(sft_batch, inputs.tok, items, max_len)
        else:
            built = await dpo_batch(self.services, inputs.tok, items, max_len, inputs.model_path)
        run.ledger.generate(len(items))
        if built.skipped:
            run.ledger.drop(TOO_LONG, built.skipped)
            run.emit(pb.EVENT_KIND_DROPPED, f"step {step + 1}: dropped {built.skipped} examples: {TOO_LONG} (nothing "
                     f"to train within policy.max_total_sequence_length {max_len})",
                     {f"dropped/{TOO_LONG}": float(built.skipped)})
        metrics = {**built.metrics, "data/cursor": float(first), "batch/trajectories_trained": float(built.trained)}
        if built.batch is None:
            run.emit(pb.EVENT_KIND_WARNING, f"step {step + 1} skipped: none of its {len(items)} examples fits "
                     f"policy.max_total_sequence_length ({max_len})")
            return metrics
        t1 = time.perf_counter()
        result = await self.services.train_step(learner_pb2.TrainStepRequest(
            run_id=run.run_id, loss_name=inputs.spec.algorithm, learning_rate=cfg.lr,
            expected_weight_version=run.version), built.batch)
        run.version = result.weight_version
        metrics.update(result.metrics)
        metrics["timing/train_s"] = time.perf_counter() - t1
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics

    async def _save(self, step: int) -> None:
        run = self.run
        folder = step_dir(run.run_dir, step)
        if folder.exists():  # an incomplete one, from before a recovery
            shutil.rmtree(folder)
        resp = await self.services.save_checkpoint(learner_pb2.SaveCheckpointRequest(
            run_id=run.run_id, path=str(folder / "learner")))
        commit_state(folder, {"algorithm": self.inputs.spec.algorithm, "step": step,
                              "weight_version": resp.weight_version, "data_cursor": self.sampler.position,
                              "ledger": run.ledger.to_dict(), "initial_val": self.trainer_state.initial_val},
                     self.inputs.spec.checkpointing.keep_last)
        self.trainer_state.checkpoints_saved += 1
        run.emit(pb.EVENT_KIND_CHECKPOINT, f"checkpoint at step {step} (version {resp.weight_version}) in {folder}")

    async def _restore(self, reason: str) -> bool:
        """Continue from the newest complete checkpoint; False when there is none."""
        run = self.run
        folder = latest(run.run_dir)
        if folder is None:
            return False
        state = json.loads((folder / "coordinator.json").read_text())
        await self.services.configure(learner_pb2.ConfigureRequest(
            run_id=run.run_id, spec_yaml=self.inputs.spec_yaml(), init_model_path=str(self.inputs.model_path)))
        loaded = await self.services.load_checkpoint(learner_pb2.LoadCheckpointRequest(
            run_id=run.run_id, path=str(folder / "learner")))
        self.trainer_state.step = state["step"]
        self.trainer_state.initial_val = state["initial_val"]
        self.sampler.seek(state["data_cursor"])
        rewind(run, reason, f"continued from {folder.name} (version {loaded.weight_version}, data cursor "
               f"{state['data_cursor']})", Ledger.from_dict(state["ledger"]), state["step"], loaded.weight_version,
               self.recovering_since or time.monotonic(), state["step"], self.progress)
        return True

    async def _finish(self) -> None:
        """Save the final policy and the plot; a run that trained nothing fails."""
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
            raise RuntimeError(f"the run trained nothing: all {ledger.generated} examples were dropped "
                               f"({TOO_LONG}); {final} is the initial policy")
        losses = [r["loss/total"] for r in run.recorder.read("metrics.jsonl") if "loss/total" in r]
        summary = f"final policy in {final}; training loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else \
            f"final policy in {final}"
        if "dpo/accuracy" in run.last_metrics:
            summary += f", preference accuracy {run.last_metrics['dpo/accuracy']:.2f}"
        if "val/reward" in run.last_metrics and self.trainer_state.initial_val is not None:
            summary += (f"; held-out reward: before {self.trainer_state.initial_val:.2f} after "
                        f"{run.last_metrics['val/reward']:.2f}")
        run.emit(pb.EVENT_KIND_INFO, summary)
