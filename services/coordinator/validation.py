"""Held-out validation: mean reward on the validation prompts, one sample each.

Greedy by default (`grpo.val_greedy`), so before/after numbers of a run are comparable.
"""

from __future__ import annotations

import math

from rlserve.config.spec import RunSpec
from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2
from services.coordinator.calls import ServiceCalls
from services.coordinator.context import Context
from services.coordinator.groups import summarize_errors
from services.coordinator.rollouts import BatchTimings, generate, score, score_items


async def evaluate(calls: ServiceCalls, spec: RunSpec, run_id: str, tok: PromptTokenizer, examples: list[Example],
                   min_version: int) -> tuple[dict[str, float], list[str]]:
    """Metrics (`val/reward` is NaN when no item could be scored) and the reward plug-ins' error messages."""
    timings = BatchTimings()
    gen = await generate(calls, spec, run_id, [tok.prompt_ids(ex) for ex in examples], tok.eos_ids, 1,
                         greedy=spec.grpo.val_greedy, seed=spec.grpo.seed, min_version=min_version, timings=timings)
    texts = [[c.samples[0].text] for c in gen.completions]
    ids = [[f"{run_id}/val/{i}"] for i in range(len(examples))]
    scored = await score(calls, spec, run_id, score_items(examples, texts, ids), timings)
    ok = [r.score for r in scored.results if r.status == reward_pb2.SCORE_STATUS_OK]
    errors = [r.error for r in scored.results if r.status != reward_pb2.SCORE_STATUS_OK]
    return {"val/reward": sum(ok) / len(ok) if ok else math.nan, "val/reward_errors": float(len(errors)),
            "val/weight_version": float(gen.weight_version)}, errors


async def validate(ctx: Context, step: int) -> dict[str, float]:
    """Evaluate the published policy and emit a VALIDATION event (the first result is the run's baseline)."""
    metrics, errors = await evaluate(ctx.calls, ctx.spec, ctx.run.run_id, ctx.tok, ctx.val_examples, ctx.run.version)
    if ctx.initial_val is None and math.isfinite(metrics["val/reward"]):
        ctx.initial_val = metrics["val/reward"]
    if ctx.initial_val is not None:
        metrics["val/reward_initial"] = ctx.initial_val
    n = len(ctx.val_examples)
    if len(errors) == n:
        result = f"held-out reward unavailable: none of the {n} prompts could be scored"
    else:
        result = f"held-out reward {metrics['val/reward']:.3f}" + (f" over the {n - len(errors)} of {n} prompts that "
                                                                   f"could be scored" if errors else "")
    detail = f"; reward errors: {summarize_errors(errors, 3)}" if errors else ""
    ctx.emit(pb.EVENT_KIND_VALIDATION, f"{result} at step {step} (version {ctx.run.version}, {n} prompts){detail}",
             metrics)
    ctx.progress()
    return metrics
