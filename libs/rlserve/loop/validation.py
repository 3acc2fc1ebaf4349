"""Held-out validation: the mean reward of one trajectory per validation prompt (with an environment, the
mean return of one episode each), greedy by default (`grpo.val_greedy`), so before/after numbers of a
run are comparable. It plays through the same producer as training (`rlserve.trajectories.rollout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.loop.state import LoopState
from rlserve.runs.record import Run
from rlserve.trajectories.generation import Plays
from rlserve.trajectories.metrics import episode_metrics
from rlserve.trajectories.queue import summarize_errors
from rlserve.trajectories.rollout import play
from rlserve.v1 import coordinator_pb2 as pb


async def evaluate(services: RunServices, inputs: RunInputs, min_version: int) -> tuple[dict[str, float], list[str]]:
    """Metrics (`val/reward` is NaN when no trajectory could be scored) and the failures' messages (reward
    plug-ins' errors, environments' failures)."""
    spec, examples = inputs.spec, list(inputs.val)
    played = await play(services, inputs, Plays(examples, 0, "val", spec.grpo.seed, 0, 1, spec.grpo.val_greedy,
                                                min_version), reference_model=None)
    trajectories = [t for g in played.groups for t in g.trajectories]
    ok = [t for t in trajectories if t.failure is None and t.reward_error is None]
    errors = [f"{t.failure[0]}: {t.failure[1]}" if t.failure else t.reward_error
              for t in trajectories if t.failure is not None or t.reward_error is not None]
    ok_groups = [g for g in played.groups if not g.env_failures and not g.reward_errors]
    return {"val/reward": sum(t.reward for t in ok) / len(ok) if ok else math.nan,
            "val/reward_errors": float(len(errors)),
            "val/weight_version": float(min((g.weight_version for g in ok_groups), default=min_version)),
            **episode_metrics(ok_groups, prefix="val/episode/")}, errors


class Validator:
    def __init__(self, inputs: RunInputs, run: Run, services: RunServices, state: LoopState,
                 progress: Callable[[], None]):
        self.inputs, self.run, self.services, self.state = inputs, run, services, state
        self.progress = progress

    async def validate(self, step: int) -> dict[str, float]:
        """Evaluate the published policy and emit a VALIDATION event (the first result is the run's baseline)."""
        version = self.state.version
        metrics, errors = await evaluate(self.services, self.inputs, version)
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
        self.run.emit(pb.EVENT_KIND_VALIDATION, f"{result} at step {step} (version {version}, {n} prompts)"
                      f"{detail}", metrics)
        self.progress()
        return metrics
