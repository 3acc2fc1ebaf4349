"""Metric sums: how losses report, how they combine over micro-batches and ranks, and the step's metrics.

A loss returns a dict of 0-d tensors whose key suffix says how it combines:
`_sum` and `_count` add, `_max` / `_min` take the max / min. Combining is on
device with no host sync (`reduce_metric_sums` over micro-batches, then
`all_reduce_metric_sums` over ranks); `finalize_metrics` turns the step's sums
into namespaced metrics with one host sync, once per step (the consistency sums
the objective adds, `mismatch_*`, become `mismatch/*`: `rlserve.algorithms.mismatch`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from rlserve.algorithms.mismatch import mismatch_metrics


def masked_extreme(x: Tensor, valid: Tensor, largest: bool) -> Tensor:
    """Max (or min) of x over valid tokens; -inf (or inf), the reduction's identity, when there are none."""
    fill = float("-inf") if largest else float("inf")
    # The extra element keeps an empty micro-batch (a padding one on a short rank) well defined.
    padded = torch.cat([torch.where(valid, x.float(), fill), x.new_full((1,), fill, dtype=torch.float32)])
    return padded.amax() if largest else padded.amin()


def _reduce_op(key: str) -> str:
    """The reduction a metric key's suffix names; any other suffix is a programming error."""
    for suffix, op in (("_sum", "sum"), ("_count", "sum"), ("_max", "max"), ("_min", "min")):
        if key.endswith(suffix):
            return op
    raise ValueError(f"metric key {key!r} must end in _sum, _count, _max or _min")


def reduce_metric_sums(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine the metric dicts of several micro-batches (same keys) into one, on device."""
    reduce = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}
    return {key: reduce[_reduce_op(key)](torch.stack([part[key] for part in parts])) for key in parts[0]}


def all_reduce_metric_sums(sums: dict[str, Tensor], group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """Combine metric sums over the ranks of `group`: three collectives (sum, max, min).

    Every rank must hold the same keys. Without an initialised process group the
    sums are returned unchanged.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return sums
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    reduced: dict[str, Tensor] = {}
    for name, op in ops.items():
        keys = sorted(k for k in sums if _reduce_op(k) == name)
        if not keys:
            continue
        buffer = torch.stack([sums[k].float() for k in keys])
        dist.all_reduce(buffer, op=op, group=group)
        reduced.update(zip(keys, buffer.unbind()))
    return reduced


# Metric name -> the sum it reports as is.
_STEP_VALUES = {
    "loss/total": "loss_sum",
    "loss/policy_gradient": "pg_loss_sum",
    "loss/kl": "kl_loss_sum",
    "batch/valid_tokens": "token_count",
    "batch/valid_sequences": "seq_count",
    "loss/preference": "preference_loss_sum",
    "loss/sft": "sft_loss_sum",
    "batch/pairs": "pair_count",
}
# Metric name -> the sum it reports divided by token_count.
_TOKEN_MEANS = {
    "loss/nll": "nll_sum",
    "policy/reference_kl": "kl_sum",
    "policy/clip_fraction": "clip_count",
    "policy/dual_clip_fraction": "dual_clip_count",
    "policy/ratio_mean": "ratio_sum",
    "policy/is_weight_mean": "is_weight_sum",
    "policy/is_truncated_fraction": "is_truncated_count",
    "policy/advantage_mean": "advantage_sum",
    "policy/entropy": "entropy_sum",
}
# Metric name -> a max / min over valid tokens.
_TOKEN_EXTREMES = {
    "policy/ratio_max": "ratio_max",
    "policy/ratio_min": "ratio_min",
    "policy/is_weight_max": "is_weight_max",
    "policy/is_weight_min": "is_weight_min",
}


# Metric name -> the sum it reports divided by pair_count (DPO).
_PAIR_MEANS = {
    "dpo/accuracy": "accuracy_count",
    "dpo/reward_margin": "margin_sum",
    "dpo/chosen_reward": "chosen_reward_sum",
    "dpo/rejected_reward": "rejected_reward_sum",
}


def finalize_metrics(sums: dict[str, Tensor], reported: Mapping[str, str] | None = None) -> dict[str, float]:
    """Namespaced step metrics from the step's reduced sums (one host sync).

    Keys not in `sums` are left out, so this serves every loss alike (a backend
    adds "entropy_sum" when it computes per-token entropies). Token means and extremes
    are left out of a step without valid tokens rather than reported as 0 or inf.
    `reported`: the loss's own metrics, name -> the sum reported as is (`Loss.reported_sums`).
    """
    keys = sorted(sums)
    values = dict(zip(keys, torch.stack([sums[k].float().reshape(()) for k in keys]).tolist()))
    out = {name: values[key] for name, key in {**_STEP_VALUES, **(reported or {})}.items() if key in values}
    tokens = values.get("token_count", 0.0)
    if tokens > 0:
        out |= {name: values[key] / tokens for name, key in _TOKEN_MEANS.items() if key in values}
        out |= {name: values[key] for name, key in _TOKEN_EXTREMES.items() if key in values}
    pairs = values.get("pair_count", 0.0)
    if pairs > 0:
        out |= {name: values[key] / pairs for name, key in _PAIR_MEANS.items() if key in values}
    return out | mismatch_metrics(values)
