"""Held-out validation: mean reward on the validation prompts, one sample each.

Greedy by default (`grpo.val_greedy`), so before/after numbers of a run are comparable.
"""

from __future__ import annotations

from rlserve.config.spec import RunSpec
from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2
from services.coordinator.calls import ServiceCalls
from services.coordinator.context import Context
from services.coordinator.rollouts import BatchTimings, generate, score, score_items


async def evaluate(calls: ServiceCalls, spec: RunSpec, run_id: str, tok: PromptTokenizer, examples: list[Example],
                   min_version: int) -> dict[str, float]:
    timings = BatchTimings()
    gen = await generate(calls, spec, run_id, [tok.prompt_ids(ex) for ex in examples], tok.eos_ids, 1,
                         greedy=spec.grpo.val_greedy, seed=spec.grpo.seed, min_version=min_version, timings=timings)
    texts = [[c.samples[0].text] for c in gen.completions]
    ids = [[f"{run_id}/val/{i}"] for i in range(len(examples))]
    scored = await score(calls, spec, run_id, score_items(examples, texts, ids), timings)
    ok = [r.score for r in scored.results if r.status == reward_pb2.SCORE_STATUS_OK]
    return {"val/reward": sum(ok) / max(1, len(ok)), "val/reward_errors": float(len(examples) - len(ok)),
            "val/weight_version": float(gen.weight_version)}


async def validate(ctx: Context, step: int) -> dict[str, float]:
    """Evaluate the published policy and emit a VALIDATION event (the first result is the run's baseline)."""
    metrics = await evaluate(ctx.calls, ctx.spec, ctx.run.run_id, ctx.tok, ctx.val_examples, ctx.run.version)
    if ctx.initial_val is None:
        ctx.initial_val = metrics["val/reward"]
    metrics["val/reward_initial"] = ctx.initial_val
    ctx.emit(pb.EVENT_KIND_VALIDATION, f"held-out reward {metrics['val/reward']:.3f} at step {step} "
             f"(version {ctx.run.version}, {len(ctx.val_examples)} prompts)", metrics)
    ctx.progress()
    return metrics
