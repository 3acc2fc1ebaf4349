"""Metric sums: combining over micro-batches and ranks, and the step's namespaced metrics."""

from __future__ import annotations

import pytest
import torch

from rlserve.algorithms.metrics import all_reduce_metric_sums, finalize_metrics, masked_extreme, reduce_metric_sums


def test_reduce_and_finalize_metrics():
    t = torch.tensor
    parts = [
        {"loss_sum": t(0.5), "token_count": t(2.0), "clip_count": t(1.0), "ratio_sum": t(2.2), "ratio_max": t(1.3),
         "ratio_min": t(0.9), "entropy_sum": t(3.0)},
        {"loss_sum": t(-0.25), "token_count": t(3.0), "clip_count": t(0.0), "ratio_sum": t(3.0), "ratio_max": t(1.1),
         "ratio_min": t(0.7), "entropy_sum": t(2.0)},
    ]
    sums = reduce_metric_sums(parts)
    assert {k: round(v.item(), 6) for k, v in sums.items()} == {
        "loss_sum": 0.25, "token_count": 5.0, "clip_count": 1.0, "ratio_sum": 5.2, "ratio_max": 1.3,
        "ratio_min": 0.7, "entropy_sum": 5.0}
    metrics = finalize_metrics(sums)
    assert metrics == pytest.approx({
        "loss/total": 0.25, "batch/valid_tokens": 5.0, "policy/clip_fraction": 0.2, "policy/ratio_mean": 1.04,
        "policy/ratio_max": 1.3, "policy/ratio_min": 0.7, "policy/entropy": 1.0})
    # No valid tokens: token means and extremes are left out, not 0 / 0.
    empty = finalize_metrics({"loss_sum": t(0.0), "token_count": t(0.0), "ratio_max": t(float("-inf"))})
    assert empty == {"loss/total": 0.0, "batch/valid_tokens": 0.0}
    with pytest.raises(ValueError, match="must end in"):
        reduce_metric_sums([{"loss": t(1.0)}])


def test_masked_extreme_skips_masked_tokens_and_is_the_identity_when_empty():
    x = torch.tensor([5.0, float("nan"), -2.0])
    valid = torch.tensor([True, False, True])
    assert masked_extreme(x, valid, largest=True).item() == 5.0
    assert masked_extreme(x, valid, largest=False).item() == -2.0
    none = torch.zeros(3, dtype=torch.bool)
    assert masked_extreme(x, none, largest=True).item() == float("-inf")
    assert masked_extreme(x, none, largest=False).item() == float("inf")


def test_all_reduce_is_a_no_op_without_a_process_group():
    sums = {"loss_sum": torch.tensor(1.0)}
    assert all_reduce_metric_sums(sums) is sums
