"""A run's generator-vs-learner consistency in one clause, from its last step's metrics (the loop's run
medians, `rlserve.loop.consistency`): the summary event and `rlserve runs get` show it."""

from __future__ import annotations


def summary(last: dict[str, float]) -> str:
    """The run's consistency in one clause (the summary event and `rlserve runs get`); "" without any."""
    if "mismatch/run_median/token_mult_prob_error" not in last:
        return ""
    return (f"consistency: median token_mult_prob_error {last['mismatch/run_median/token_mult_prob_error']:.4f}, "
            f"median |delta logprob| {last['mismatch/run_median/logprob_abs_diff_mean']:.4f} "
            f"(last step: max {last.get('mismatch/logprob_abs_diff_max', float('nan')):.4f}, IS truncated "
            f"{last.get('mismatch/is_truncated_fraction', float('nan')):.2%})")
