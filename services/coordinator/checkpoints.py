"""Run checkpoints: the learner's (torch distributed checkpoint) plus the coordinator's state.

The coordinator's part (step, version, data cursor, ledger, buffered groups,
reward version, initial policy) is written last, so a checkpoint folder
without coordinator.json is incomplete and never resumed from. Buffered
groups are saved, so a resume loses no trajectory that was counted as
generated. The data cursor is that of the first step whose groups are not in
the checkpoint (`produced_steps * num_prompts_per_step`), never the position
of a generation still in progress, so a resumed run trains exactly the
prompts an uninterrupted one would.

Restoring commits everything at once, after the learner has loaded: until
then GetRun shows the run as it was, afterwards as the checkpoint left it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import learner_pb2
from services.coordinator.context import Context
from services.coordinator.groups import Group, GroupQueue
from services.coordinator.ledger import RECOVERED, Ledger


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (run_dir / "checkpoints").glob("step_*/coordinator.json"))
    return done[-1] if done else None


async def save(ctx: Context, step: int) -> Path:
    run = ctx.run
    folder = step_dir(run.run_dir, step)
    if folder.exists():  # an incomplete one, from before a recovery
        shutil.rmtree(folder)
    resp = await ctx.calls.save_checkpoint(learner_pb2.SaveCheckpointRequest(
        run_id=run.run_id, path=str(folder / "learner")))
    # Taken without awaiting anything, so the producer cannot change it half-way.
    buffer = ctx.queue.snapshot()
    if sum(g.size for g in buffer) != run.ledger.in_flight:
        raise RuntimeError(f"checkpoint at step {step}: {run.ledger.in_flight} trajectories in flight but "
                           f"{sum(g.size for g in buffer)} buffered")
    state = {
        "step": step, "weight_version": resp.weight_version, "produced_steps": ctx.produced_steps,
        "data_cursor": ctx.produced_steps * ctx.spec.grpo.num_prompts_per_step,
        "ledger": run.ledger.to_dict(), "reward_version": ctx.reward_version,
        "init_model": str(ctx.init_model), "initial_val": ctx.initial_val,
        "buffer": [dataclasses.asdict(g) for g in buffer],
    }
    tmp = folder / ".coordinator.json.tmp"
    tmp.write_text(json.dumps(state) + "\n")
    tmp.replace(folder / "coordinator.json")
    kept = sorted(p.parent for p in (run.run_dir / "checkpoints").glob("step_*/coordinator.json"))
    for old in kept[: -ctx.spec.checkpointing.keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    ctx.checkpoints_saved += 1
    ctx.emit(pb.EVENT_KIND_CHECKPOINT, f"checkpoint at step {step} (version {resp.weight_version}) in {folder}")
    return folder


async def restore(ctx: Context, reason: str) -> bool:
    """Continue from the newest complete checkpoint; False when there is none (see `start_over`)."""
    run = ctx.run
    folder = latest(run.run_dir)
    if folder is None:
        return False
    since = ctx.recovering_since or time.monotonic()
    state = json.loads((folder / "coordinator.json").read_text())
    await ctx.calls.configure(learner_pb2.ConfigureRequest(
        run_id=run.run_id, spec_yaml=(run.run_dir / "spec.yaml").read_text(), init_model_path=state["init_model"]))
    loaded = await ctx.calls.load_checkpoint(learner_pb2.LoadCheckpointRequest(
        run_id=run.run_id, path=str(folder / "learner")))
    buffer = [Group(**g) for g in state["buffer"]]
    # Commit: nothing is awaited from here on.
    ctx.init_model = Path(state["init_model"])
    ctx.produced_steps = state["produced_steps"]
    ctx.sampler.seek(state["data_cursor"])
    ctx.queue = GroupQueue(buffer)
    ctx.reward_version = state["reward_version"]
    ctx.initial_val = state["initial_val"]
    ctx.trainer_step = state["step"]
    _rewind(ctx, reason, f"continued from {folder.name} (version {loaded.weight_version}, {len(buffer)} buffered "
            f"groups, data cursor {state['data_cursor']})", Ledger.from_dict(state["ledger"]), state["step"],
            loaded.weight_version, since, metrics_through=state["step"])
    return True


def start_over(ctx: Context, reason: str) -> None:
    """No complete checkpoint: the run goes back to its very start (what it did is undone and counted)."""
    _rewind(ctx, reason, "no complete checkpoint: started over from the initial policy", Ledger(), 0, 0,
            ctx.recovering_since or time.monotonic(), metrics_through=-1)  # the start's validation is redone too


def _rewind(ctx: Context, reason: str, how: str, checkpoint: Ledger, step: int, version: int, since: float,
            metrics_through: int) -> None:
    run = ctx.run
    ledger, changes = run.ledger.rewind(checkpoint)
    redone = max(0, run.step - step)
    run.ledger, run.step, run.version = ledger, step, version
    run.recorder.rewind(metrics_through)
    rows = run.recorder.read("metrics.jsonl")
    run.last_metrics = {k: v for k, v in rows[-1].items() if k != "step" and isinstance(v, float)} if rows else {}
    run.save()
    lost = int(changes.get(f"dropped/{RECOVERED}", 0))
    undone = -int(changes.get("trained", 0))
    ctx.emit(pb.EVENT_KIND_RECOVERED,
             f"{reason}; {how}: {redone} steps to redo, {lost} trajectories generated after the checkpoint "
             f"dropped ({RECOVERED}), of which {undone} had been trained",
             {**changes, "recovery/steps_redone": float(redone), "recovery/seconds": time.monotonic() - since})
    ctx.progress()
