"""Step metrics reduce over data-parallel ranks: sums add, extremes take max/min (two gloo ranks)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from rlserve.algorithms.metrics import all_reduce_metric_sums


def _all_reduce_worker(rank: int, store_path: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        sums = {"clip_count": torch.tensor(1.0 + rank), "ratio_max": torch.tensor(3.0 - 2 * rank),
                "ratio_min": torch.tensor(0.5 + rank), "loss_sum": torch.tensor(0.25 * (rank + 1))}
        queue.put((rank, {k: v.item() for k, v in all_reduce_metric_sums(sums).items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_all_reduce_over_two_gloo_ranks(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_worker, args=(rank, os.fspath(tmp_path / "store"), queue))
             for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=50) for _ in procs)
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    expected = {"clip_count": 3.0, "ratio_max": 3.0, "ratio_min": 0.5, "loss_sum": 0.75}
    assert results[0] == pytest.approx(expected) and results[1] == pytest.approx(expected)
