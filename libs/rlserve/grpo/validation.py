"""Held-out validation: mean reward on the validation prompts, one sample each (with an environment:
the mean return of one episode each, with how the episodes ended and the environment's metrics).

Greedy by default (`grpo.val_greedy`), so before/after numbers of a run are comparable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rlserve.grpo.episodes import evaluate_episodes
from rlserve.grpo.groups import summarize_errors
from rlserve.grpo.rollouts import BatchTimings, generate, score, score_items
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import RunInputs, TrainerState
from rlserve.runs.record import Run
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import reward_pb2


async def evaluate(services: RunServices, inputs: RunInputs, min_version: int) -> tuple[dict[str, float], list[str]]:
    """Metrics (`val/reward` is NaN when no item could be scored) and the reward plug-ins' error messages."""
    if inputs.spec.env.enabled:
        return await evaluate_episodes(services, inputs, min_version)
    spec, examples = inputs.spec, list(inputs.val)
    timings = BatchTimings()
    gen = await generate(services, inputs, [inputs.tok.prompt_ids(ex) for ex in examples], 1,
                         greedy=spec.grpo.val_greedy, seed=spec.grpo.seed, min_version=min_version, timings=timings)
    texts = [[c.samples[0].text] for c in gen.completions]
    ids = [[f"{inputs.run_id}/val/{i}"] for i in range(len(examples))]
    scored = await score(services, inputs, score_items(examples, texts, ids), timings)
    ok = [r.score for r in scored.results if r.status == reward_pb2.SCORE_STATUS_OK]
    errors = [r.error for r in scored.results if r.status != reward_pb2.SCORE_STATUS_OK]
    return {"val/reward": sum(ok) / len(ok) if ok else math.nan, "val/reward_errors": float(len(errors)),
            "val/weight_version": float(gen.weight_version)}, errors


class Validator:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, state: TrainerState,
                 progress: Callable[[], None]):
        self.inputs, self.run, self.services, self.state = inputs, run, services, state
        self.progress = progress

    async def validate(self, step: int) -> dict[str, float]:
        """Evaluate the published policy and emit a VALIDATION event (the first result is the run's baseline)."""
        metrics, errors = await evaluate(self.services, self.inputs, self.run.version)
        if self.state.initial_val is None and math.isfinite(metrics["val/reward"]):
            self.state.initial_val = metrics["val/reward"]
        if self.state.initial_val is not None:
            metrics["val/reward_initial"] = self.state.initial_val
        n = len(self.inputs.val)
        if len(errors) == n:
            result = f"held-out reward unavailable: none of the {n} prompts could be scored"
        else:
            result = f"held-out reward {metrics['val/reward']:.3f}" + (
                f" over the {n - len(errors)} of {n} prompts that could be scored" if errors else "")
        detail = f"; reward errors: {summarize_errors(errors, 3)}" if errors else ""
        self.run.emit(pb.EVENT_KIND_VALIDATION, f"{result} at step {step} (version {self.run.version}, {n} prompts)"
                      f"{detail}", metrics)
        self.progress()
        return metrics
