"""Run checkpoints: the learner's (torch distributed checkpoint) plus the coordinator's state.

The coordinator's part (step, version, data cursor, ledger, buffered groups)
is written last, so a checkpoint folder without coordinator.json is
incomplete and never resumed from. Buffered groups are saved, so a resume
loses no trajectory that was counted as generated.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2
from services.coordinator.context import Context
from services.coordinator.groups import Group
from services.coordinator.ledger import Ledger


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (run_dir / "checkpoints").glob("step_*/coordinator.json"))
    return done[-1] if done else None


async def save(ctx: Context, step: int) -> Path:
    run = ctx.run
    folder = step_dir(run.run_dir, step)
    resp = await ctx.calls.save_checkpoint(learner_pb2.SaveCheckpointRequest(
        run_id=run.run_id, path=str(folder / "learner")))
    # Taken without awaiting anything, so the producer cannot change it half-way.
    state = {
        "step": step, "weight_version": resp.weight_version, "produced_steps": ctx.produced_steps,
        "sampler": ctx.sampler.state(), "ledger": run.ledger.to_dict(), "reward_version": ctx.reward_version,
        "init_model": str(ctx.init_model), "initial_val": ctx.initial_val,
        "buffer": [dataclasses.asdict(g) for g in ctx.queue.snapshot()],
    }
    tmp = folder / ".coordinator.json.tmp"
    tmp.write_text(json.dumps(state) + "\n")
    tmp.replace(folder / "coordinator.json")
    kept = sorted(p.parent for p in (run.run_dir / "checkpoints").glob("step_*/coordinator.json"))
    for old in kept[: -ctx.spec.checkpointing.keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    ctx.emit(pb.EVENT_KIND_CHECKPOINT, f"checkpoint at step {step} (version {resp.weight_version}) in {folder}")
    return folder


async def restore(ctx: Context) -> bool:
    """Reload the newest complete checkpoint; False when there is none (the run starts over)."""
    run = ctx.run
    folder = latest(run.run_dir)
    if folder is None:
        ctx.emit(pb.EVENT_KIND_INFO, "no complete checkpoint; starting the run from the beginning")
        return False
    state = json.loads((folder / "coordinator.json").read_text())
    ctx.init_model = Path(state["init_model"])
    await ctx.calls.configure(learner_pb2.ConfigureRequest(
        run_id=run.run_id, spec_yaml=(run.run_dir / "spec.yaml").read_text(), init_model_path=str(ctx.init_model)))
    loaded = await ctx.calls.load_checkpoint(learner_pb2.LoadCheckpointRequest(
        run_id=run.run_id, path=str(folder / "learner")))
    run.version = loaded.weight_version
    run.step = ctx.trainer_step = state["step"]
    ctx.produced_steps = state["produced_steps"]
    ctx.sampler.restore(state["sampler"])
    run.ledger = Ledger.from_dict(state["ledger"])
    ctx.queue.restore([Group(**g) for g in state["buffer"]])
    ctx.reward_version = state["reward_version"]
    ctx.initial_val = state["initial_val"]
    ctx.emit(pb.EVENT_KIND_INFO, f"resumed from {folder.name} (version {run.version}, "
             f"{len(state['buffer'])} buffered groups)")
    return True
