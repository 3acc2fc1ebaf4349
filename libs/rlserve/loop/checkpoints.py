"""Run checkpoints: the learner's (a torch distributed checkpoint) plus the loop's state.

The loop's part (`CheckpointState`: step, version, data cursor, ledger, initial policy, and the
algorithm's own part, e.g. an RL run's queued steps) is written last, as coordinator.json, so a
checkpoint folder without it is incomplete and never resumed from. The data cursor is that of the
first step not in the checkpoint (where the last committed step's prompts end), never the position
of a generation still in progress, so a resumed run trains exactly the prompts an uninterrupted one
would.

Restoring commits everything at once, after the learner has loaded: until then GetRun shows the run
as it was, afterwards as the checkpoint left it.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlserve.loop.algorithm import Algorithm
from rlserve.loop.inputs import RunInputs
from rlserve.loop.learner import configure_learner
from rlserve.loop.services import RunServices
from rlserve.loop.state import LoopState
from rlserve.runs.ledger import RECOVERED, Ledger
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2

# coordinator.json keys of checkpoints written before the algorithm's part had a key of its own (GRPO's).
_LEGACY_ALGORITHM_KEYS = ("produced_steps", "reward_version", "buffer")


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (run_dir / "checkpoints").glob("step_*/coordinator.json"))
    return done[-1] if done else None


@dataclass(frozen=True)
class CheckpointState:
    """The loop's part of a checkpoint (coordinator.json)."""

    algorithm: str
    step: int
    weight_version: int
    data_cursor: int
    ledger: Ledger
    # The policy the learner is configured on (an RL run's SFT warm start, or the model).
    init_model: str
    initial_val: float | None
    algorithm_state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"algorithm": self.algorithm, "step": self.step, "weight_version": self.weight_version,
                           "data_cursor": self.data_cursor, "ledger": self.ledger.to_dict(),
                           "init_model": self.init_model, "initial_val": self.initial_val,
                           "algorithm_state": self.algorithm_state}) + "\n"

    @classmethod
    def from_json(cls, text: str, inputs: RunInputs) -> CheckpointState:
        """Also the layouts written before this type: GRPO's kept its part at the top level, and
        supervised runs' named no initial policy (theirs is the model)."""
        saved = json.loads(text)
        own = saved.get("algorithm_state", {k: saved[k] for k in _LEGACY_ALGORITHM_KEYS if k in saved})
        return cls(saved.get("algorithm", inputs.spec.algorithm), saved["step"], saved["weight_version"],
                   saved["data_cursor"], Ledger.from_dict(saved["ledger"]),
                   saved.get("init_model", str(inputs.model_path)), saved["initial_val"], own)

    def commit(self, folder: Path, keep_last: int) -> None:
        """Write coordinator.json (atomically: its presence marks the folder complete) and remove the complete
        checkpoints older than the newest `keep_last`."""
        tmp = folder / ".coordinator.json.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(folder / "coordinator.json")
        kept = sorted(p.parent for p in folder.parent.glob("step_*/coordinator.json"))
        for old in kept[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


class Checkpoints:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, state: LoopState,
                 progress: Callable[[], None]):
        self.inputs, self.run, self.services, self.state = inputs, run, services, state
        self.progress = progress

    async def save(self, step: int, algorithm: Algorithm) -> Path:
        run = self.run
        folder = step_dir(run.run_dir, step)
        if folder.exists():  # an incomplete one, from before a recovery
            shutil.rmtree(folder)
        resp = await self.services.save_checkpoint(learner_pb2.SaveCheckpointRequest(
            run_id=run.run_id, path=str(folder / "learner")))
        # Taken together without awaiting anything, after the learner's save: work beside the steps (an RL
        # run's producer) goes on meanwhile, and its cursor, queue and ledger must be of one moment.
        CheckpointState(self.inputs.spec.algorithm, step, resp.weight_version, algorithm.data_cursor, run.ledger,
                        str(self.state.init_model), self.state.initial_val, algorithm.checkpoint_state(),
                        ).commit(folder, self.inputs.spec.checkpointing.keep_last)
        self.state.checkpoints_saved += 1
        run.emit(pb.EVENT_KIND_CHECKPOINT, f"checkpoint at step {step} (version {resp.weight_version}) in {folder}")
        return folder

    async def restore(self, reason: str, since: float | None, algorithm: Algorithm) -> bool:
        """Continue from the newest complete checkpoint; False when there is none (see `start_over`)."""
        folder = latest(self.run.run_dir)
        if folder is None:
            return False
        saved = CheckpointState.from_json((folder / "coordinator.json").read_text(), self.inputs)
        await configure_learner(self.services, self.inputs, Path(saved.init_model))
        loaded = await self.services.load_checkpoint(learner_pb2.LoadCheckpointRequest(
            run_id=self.run.run_id, path=str(folder / "learner")))
        # Commit: nothing is awaited from here on.
        state = self.state
        state.init_model, state.initial_val = Path(saved.init_model), saved.initial_val
        state.step, state.version = saved.step, loaded.weight_version
        detail = algorithm.restore(saved.data_cursor, saved.algorithm_state)
        self._rewind(reason, f"continued from {folder.name} (version {loaded.weight_version}, "
                     f"{detail + ', ' if detail else ''}data cursor {saved.data_cursor})", saved.ledger,
                     saved.step, loaded.weight_version, since or time.monotonic(), metrics_through=saved.step)
        return True

    def start_over(self, reason: str, since: float | None) -> None:
        """No complete checkpoint: the run goes back to its very start (what it did is undone and counted)."""
        self._rewind(reason, "no complete checkpoint: started over from the initial policy", Ledger(), 0, 0,
                     since or time.monotonic(), metrics_through=-1)  # the start's validation is redone too

    def _rewind(self, reason: str, how: str, checkpoint: Ledger, step: int, version: int, since: float,
                metrics_through: int) -> None:
        """Take the run record back to a checkpoint (or its start) and announce what that cost (RECOVERED)."""
        changes = self.run.rewind(checkpoint, step, version, metrics_through)
        lost = int(changes.get(f"dropped/{RECOVERED}", 0))
        undone = -int(changes.get("trained", 0))
        self.run.emit(pb.EVENT_KIND_RECOVERED,
                      f"{reason}; {how}: {changes['recovery/steps_redone']:.0f} steps to redo, {lost} trajectories "
                      f"generated after the checkpoint dropped ({RECOVERED}), of which {undone} had been trained",
                      {**changes, "recovery/seconds": time.monotonic() - since})
        self.progress()
