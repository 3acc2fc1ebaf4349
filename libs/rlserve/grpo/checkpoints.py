"""Run checkpoints: the learner's (torch distributed checkpoint) plus the loop's state.

The loop's part (step, version, data cursor, ledger, queued steps, reward
version, initial policy) is written last, so a checkpoint folder without
coordinator.json is incomplete and never resumed from. Queued steps are
saved, so a resume loses no trajectory that was counted as generated. The
data cursor is that of the first step not in the checkpoint (where the last
committed step's prompts end), never the position of a generation still in
progress, so a resumed run trains exactly the prompts an uninterrupted one
would.

Restoring commits everything at once, after the learner has loaded: until
then GetRun shows the run as it was, afterwards as the checkpoint left it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from rlserve.grpo.groups import Group, ProducedStep, StepQueue
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import ProducerState, RunInputs, TrainerState
from rlserve.runs.ledger import RECOVERED, Ledger
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (run_dir / "checkpoints").glob("step_*/coordinator.json"))
    return done[-1] if done else None


def commit_state(folder: Path, state: dict, keep_last: int) -> None:
    """Write a checkpoint's coordinator.json (atomically: its presence marks the folder complete) and
    remove the complete checkpoints older than the newest `keep_last`."""
    tmp = folder / ".coordinator.json.tmp"
    tmp.write_text(json.dumps(state) + "\n")
    tmp.replace(folder / "coordinator.json")
    kept = sorted(p.parent for p in folder.parent.glob("step_*/coordinator.json"))
    for old in kept[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def rewind(run: Run, reason: str, how: str, checkpoint: Ledger, step: int, version: int, since: float,
           metrics_through: int, progress: Callable[[], None]) -> None:
    """Take the run record back to a checkpoint (or its start) and announce what that cost (RECOVERED)."""
    ledger, changes = run.ledger.rewind(checkpoint)
    redone = max(0, run.step - step)
    run.ledger, run.step, run.version = ledger, step, version
    run.recorder.rewind(metrics_through)
    rows = run.recorder.read("metrics.jsonl")
    run.last_metrics = {k: v for k, v in rows[-1].items() if k != "step" and isinstance(v, float)} if rows else {}
    run.save()
    lost = int(changes.get(f"dropped/{RECOVERED}", 0))
    undone = -int(changes.get("trained", 0))
    run.emit(pb.EVENT_KIND_RECOVERED,
             f"{reason}; {how}: {redone} steps to redo, {lost} trajectories generated after the checkpoint "
             f"dropped ({RECOVERED}), of which {undone} had been trained",
             {**changes, "recovery/steps_redone": float(redone), "recovery/seconds": time.monotonic() - since})
    progress()


def _queued_steps(saved: list[dict]) -> list[ProducedStep]:
    """The saved queue. Checkpoints written before the queue held whole steps saved a flat list of
    groups, each naming its step (and its trajectory ids, no longer kept)."""
    if saved and "groups" not in saved[0]:
        by_step: dict[int, list[Group]] = {}
        for g in saved:
            step = g.pop("step")
            g.pop("ids", None)
            by_step.setdefault(step, []).append(Group(**g))
        return [ProducedStep(step, groups, {}, min(g.prompt_index for g in groups))
                for step, groups in sorted(by_step.items())]
    # Steps saved before they recorded their data cursor start at their first group's prompt.
    return [ProducedStep(s["step"], [Group(**g) for g in s["groups"]], s["metrics"],
                         s.get("data_cursor", min((g["prompt_index"] for g in s["groups"]), default=0)))
            for s in saved]


class Checkpoints:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, producer: ProducerState,
                 trainer: TrainerState, queue: StepQueue, progress: Callable[[], None]):
        self.inputs, self.run, self.services = inputs, run, services
        self.producer, self.trainer, self.queue = producer, trainer, queue
        self.progress = progress

    async def save(self, step: int) -> Path:
        run = self.run
        folder = step_dir(run.run_dir, step)
        if folder.exists():  # an incomplete one, from before a recovery
            shutil.rmtree(folder)
        resp = await self.services.save_checkpoint(learner_pb2.SaveCheckpointRequest(
            run_id=run.run_id, path=str(folder / "learner")))
        # Taken without awaiting anything, so the producer cannot change it half-way.
        queued = self.queue.snapshot()
        if sum(s.size for s in queued) != run.ledger.in_flight:
            raise RuntimeError(f"checkpoint at step {step}: {run.ledger.in_flight} trajectories in flight but "
                               f"{sum(s.size for s in queued)} queued")
        state = {
            "step": step, "weight_version": resp.weight_version, "produced_steps": self.producer.produced_steps,
            "data_cursor": self.producer.data_cursor,
            "ledger": run.ledger.to_dict(), "reward_version": self.producer.reward_version,
            "init_model": str(self.trainer.init_model), "initial_val": self.trainer.initial_val,
            "buffer": [dataclasses.asdict(s) for s in queued],
        }
        commit_state(folder, state, self.inputs.spec.checkpointing.keep_last)
        self.trainer.checkpoints_saved += 1
        run.emit(pb.EVENT_KIND_CHECKPOINT, f"checkpoint at step {step} (version {resp.weight_version}) in {folder}")
        return folder

    async def restore(self, reason: str, since: float | None) -> bool:
        """Continue from the newest complete checkpoint; False when there is none (see `start_over`)."""
        run = self.run
        folder = latest(run.run_dir)
        if folder is None:
            return False
        since = since or time.monotonic()
        state = json.loads((folder / "coordinator.json").read_text())
        await self.services.configure(learner_pb2.ConfigureRequest(
            run_id=run.run_id, spec_yaml=self.inputs.spec_yaml(), init_model_path=state["init_model"],
            shared_base=self.inputs.spec.shares_deployed_base))
        loaded = await self.services.load_checkpoint(learner_pb2.LoadCheckpointRequest(
            run_id=run.run_id, path=str(folder / "learner")))
        queued = _queued_steps(state["buffer"])
        # Commit: nothing is awaited from here on.
        self.trainer.init_model = Path(state["init_model"])
        self.trainer.initial_val = state["initial_val"]
        self.trainer.step = state["step"]
        self.producer.produced_steps = state["produced_steps"]
        self.producer.sampler.seek(state["data_cursor"])
        self.producer.data_cursor = state["data_cursor"]
        self.producer.reward_version = state["reward_version"]
        self.queue.load(queued, state["step"])
        self._rewind(reason, f"continued from {folder.name} (version {loaded.weight_version}, "
                     f"{sum(len(s.groups) for s in queued)} buffered groups, data cursor {state['data_cursor']})",
                     Ledger.from_dict(state["ledger"]), state["step"], loaded.weight_version, since,
                     metrics_through=state["step"])
        return True

    def start_over(self, reason: str, since: float | None) -> None:
        """No complete checkpoint: the run goes back to its very start (what it did is undone and counted)."""
        self._rewind(reason, "no complete checkpoint: started over from the initial policy", Ledger(), 0, 0,
                     since or time.monotonic(), metrics_through=-1)  # the start's validation is redone too

    def _rewind(self, reason: str, how: str, checkpoint: Ledger, step: int, version: int, since: float,
                metrics_through: int) -> None:
        rewind(self.run, reason, how, checkpoint, step, version, since, metrics_through, self.progress)
