"""Rollout-training consistency: how far the generator's logprobs are from the learner's, per step.

The sampled tokens' logprobs as the engine reported them (gen) are compared with the learner's at the
start of the step (prev: the weights the step starts from, before any update), on the tokens the loss
counts. Per token, with d = prev - gen:

    token_mult_prob_error   exp(|d|), its mean over tokens: NeMo-RL's metric (ClippedPGLossFn,
                            `token_mult_prob_error`; its nightly recipes fail at a median of 1.1)
    gen_kl_k3               exp(d) - 1 - d, Schulman's k3 estimate of KL(pi_gen || pi_learner) from
                            the generator's samples (NeMo-RL's `gen_kl_error` with k3)
    logprob_abs_diff        |d|, mean and max (miles asserts <= 0.03 in CI)
    is_truncated_fraction   the share of tokens whose importance weight exp(d) the run's truncation
                            (`loss_fn.truncated_importance_sampling_*`: tis caps it, icepop masks it)
                            cuts, whether or not `use_importance_sampling_correction` applies it

Every metric is also split by the token's age (learner version minus the version that sampled it:
an async run's tokens are a version or more behind, so age 0 isolates the engine's own numerics) and,
in multi-turn runs, by the turn of its episode. Sums follow `rlserve.algorithms.metrics`' suffixes, so
they combine over micro-batches and ranks like every loss metric; `mismatch_metrics` names them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.config.algorithms import LossFnCfg

# Age buckets 0, 1, 2 and "3 or more"; turn buckets 1, 2, 3 and "4 or more".
AGE_BUCKETS = 4
TURN_BUCKETS = 4
# Metric name -> the per-token quantity's sum key; all are means over the bucket's tokens.
_MEANS = {"token_mult_prob_error": "prob_error_sum", "gen_kl_k3": "gen_kl_sum",
          "logprob_abs_diff_mean": "abs_diff_sum", "is_truncated_fraction": "truncated_count"}


def _bucket_label(kind: str, k: int, buckets: int) -> str:
    first = 0 if kind == "age" else 1
    value = first + k
    return f"{kind}_{value}" + ("_plus" if k == buckets - 1 else "")


def truncated_by(cfg: LossFnCfg, w: Tensor) -> Tensor:
    """Which importance weights the run's truncation would cut (tis: above the cap; icepop: outside
    [ratio_min, ratio]); none without a truncation ratio."""
    hi = cfg.truncated_importance_sampling_ratio
    if hi is None:
        return torch.zeros_like(w, dtype=torch.bool)
    if cfg.truncated_importance_sampling_type == "tis":
        return w > hi
    lo = cfg.truncated_importance_sampling_ratio_min
    return (w < (1.0 / hi if lo is None else lo)) | (w > hi)


def _masked_max(x: Tensor, valid: Tensor) -> Tensor:
    """Max over valid tokens; -inf (the max's identity) without any (`metrics.masked_extreme`'s rule)."""
    return torch.cat([torch.where(valid, x, float("-inf")), x.new_full((1,), float("-inf"))]).amax()


def _sums(prefix: str, valid: Tensor, err: Tensor, kl: Tensor, diff: Tensor, cut: Tensor) -> dict[str, Tensor]:
    weight = valid.float()
    return {f"mismatch{prefix}_tokens_count": weight.sum(),
            f"mismatch{prefix}_prob_error_sum": (err * weight).sum(),
            f"mismatch{prefix}_gen_kl_sum": (kl * weight).sum(),
            f"mismatch{prefix}_abs_diff_sum": (diff * weight).sum(),
            f"mismatch{prefix}_abs_diff_max": _masked_max(diff, valid),
            f"mismatch{prefix}_truncated_count": (cut.float() * weight).sum()}


@torch.no_grad()
def mismatch_sums(prev: Tensor, gen: Tensor, valid: Tensor, cfg: LossFnCfg, ages: Tensor | None = None,
                  turns: Tensor | None = None) -> dict[str, Tensor]:
    """This micro-batch's consistency sums over its `valid` tokens (flat [N] vectors); with `ages` and
    `turns` (int [N]), the same per age and turn bucket (every bucket present, possibly empty, so every
    micro-batch and rank holds the same keys)."""
    prev, gen = prev.detach().float(), gen.detach().float()
    # A token one side gave -inf (a top-k mismatch) is left out rather than poisoning the sums.
    valid = valid & torch.isfinite(prev) & torch.isfinite(gen)
    d = torch.where(valid, prev - gen, 0.0)
    diff = d.abs()
    w = torch.exp(d)
    parts = (torch.exp(diff), torch.expm1(d) - d, diff, truncated_by(cfg, w))
    sums = _sums("", valid, *parts)
    for kind, values, buckets in (("age", ages, AGE_BUCKETS), ("turn", turns, TURN_BUCKETS)):
        if values is None:
            continue
        index = (values.long() - (0 if kind == "age" else 1)).clamp(0, buckets - 1)
        for k in range(buckets):
            sums.update(_sums(f"_{kind}{k}", valid & (index == k), *parts))
    return sums


def mismatch_metrics(values: dict[str, float]) -> dict[str, float]:
    """`mismatch/<metric>` (every valid token) and `mismatch/<age_a|turn_t>/<metric>` (buckets with tokens)
    from the step's reduced sums; nothing for a step without generator logprobs."""
    out: dict[str, float] = {}
    scopes = [("", "")] + [(f"_{kind}{k}", _bucket_label(kind, k, n) + "/")
                           for kind, n in (("age", AGE_BUCKETS), ("turn", TURN_BUCKETS)) for k in range(n)]
    for key, label in scopes:
        tokens = values.get(f"mismatch{key}_tokens_count", 0.0)
        if tokens <= 0:
            continue
        for name, sum_key in _MEANS.items():
            out[f"mismatch/{label}{name}"] = values[f"mismatch{key}_{sum_key}"] / tokens
        out[f"mismatch/{label}logprob_abs_diff_max"] = values[f"mismatch{key}_abs_diff_max"]
        if label:
            out[f"mismatch/{label}tokens"] = tokens
    return out
