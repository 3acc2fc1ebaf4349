"""The consistency contract at run time: after every step, the generator-vs-learner metrics against the
run's bound (`loss_fn.mismatch_guard`), and the run's medians for the summary and `rlserve runs get`.

The learner measures (`rlserve.algorithms.mismatch`: `mismatch/*` in the step's metrics); this module
decides. A step whose watched metric is above `max` gets a WARNING event that names the step, the
metric, its value and the likely causes, read off the step's own splits (an old age bucket far above
the newest one is staleness; the newest tokens far off is the engine's weights or numerics); then
`warn` goes on, `pause` checkpoints and stops the run PAUSED (resumable), `fail` fails it. Every step
also carries the run's medians so far (NeMo-RL's nightly contract is on the median of
token_mult_prob_error): `mismatch/run_median/*`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rlserve.config import RunSpec

# The run medians every step carries (metric names under mismatch/).
MEDIANS = ("token_mult_prob_error", "logprob_abs_diff_mean")
# Beyond these the newest tokens' logprobs are not one model's numerics any more: other weights answer.
WEIGHTS_OFF = {"token_mult_prob_error": 1.5, "logprob_abs_diff_mean": 0.4, "gen_kl_k3": 0.1}


@dataclass(frozen=True)
class Crossing:
    """A step whose watched metric crossed the guard's bound."""

    action: str  # warn | pause | fail
    message: str


class ConsistencyGuard:
    def __init__(self, spec: RunSpec, past_rows: list[dict]):
        self.spec, self.cfg = spec, spec.loss_fn.mismatch_guard
        self.key = f"mismatch/{self.cfg.metric}"
        self.history = {name: [r[f"mismatch/{name}"] for r in past_rows if f"mismatch/{name}" in r]
                        for name in MEDIANS}

    def check(self, step: int, metrics: dict[str, float]) -> Crossing | None:
        """Add the run's medians to `metrics` (step `step`'s); the crossing, if its value is over the bound."""
        for name, seen in self.history.items():
            if f"mismatch/{name}" in metrics:
                seen.append(metrics[f"mismatch/{name}"])
                metrics[f"mismatch/run_median/{name}"] = statistics.median(seen)
        value = metrics.get(self.key)
        if not self.cfg.enabled or value is None:
            return None
        over = value > self.cfg.max
        metrics["mismatch/guard_exceeded"] = float(over)
        if not over:
            return None
        then = {"warn": "the run goes on", "pause": "the run pauses after a checkpoint at this step (resume it with "
                "`rlserve submit --resume RUN_ID`)", "fail": "the run fails"}[self.cfg.action]
        return Crossing(self.cfg.action, (
            f"step {step}: {self.key} = {value:.4g} is above loss_fn.mismatch_guard.max {self.cfg.max:g} "
            f"(the generator's logprobs against the learner's at the start of the step); likely causes: "
            f"{'; '.join(self.likely_causes(metrics))}; {then}"))

    def likely_causes(self, m: dict[str, float]) -> list[str]:
        """Causes in order of likelihood, from what the step's splits show."""
        causes = []
        newest = {name: m.get(f"mismatch/age_0/{name}", m.get(f"mismatch/{name}")) for name in WEIGHTS_OFF}
        if any(v is not None and v > WEIGHTS_OFF[name] for name, v in newest.items()):
            causes.append("the engines serve other weights than the learner's (a weight sync that failed or was "
                          "corrupted, an engine restarted on older weights): check the WEIGHT_SYNC events and "
                          "`GetInfo(weight_digests)`")
        stale = [k.split("/")[1] for k in m if k.startswith("mismatch/age_") and k.endswith("/logprob_abs_diff_mean")
                 and not k.startswith("mismatch/age_0/")]
        if stale and any(m[f"mismatch/{a}/logprob_abs_diff_mean"] > 2 * m.get("mismatch/age_0/logprob_abs_diff_mean",
                                                                                0.0) for a in stale):
            causes.append("stale tokens: those sampled by older weights differ by the policy's own change (lower "
                          "grpo.async_grpo.max_trajectory_age_steps, turn on loss_fn.use_importance_sampling_correction, "
                          "or guard age_0/ only)")
        turns = sorted(k for k in m if k.startswith("mismatch/turn_") and k.endswith("/logprob_abs_diff_mean"))
        if len(turns) > 1 and m[turns[-1]] > 2 * m[turns[0]]:
            causes.append("later turns drift more: prefixes recomputed under new weights (in-flight updates with "
                          "in_flight_kv_cache: keep) or the environment's tokens between turns")
        if not self.spec.policy.routing_replay:
            causes.append("if the model is a mixture of experts, the engine routing tokens to other experts than the "
                          "learner (policy.routing_replay: true replays the rollout's routing)")
        causes.append("numerics: the rollout's dtype or kernels against the learner's policy.precision (bf16 engines "
                      "measure 1.01-1.03 token_mult_prob_error against a bf16 learner; BENCHMARKS.md)")
        return causes

