"""The bucket writer the learner's store copy goes through."""

from __future__ import annotations

import pytest
import torch

from rlserve.weights.buckets import BucketWriter, tensor_bytes


def write(named: list[tuple[str, torch.Tensor]], max_bytes: int) -> tuple[BucketWriter, list[dict]]:
    out: list[dict] = []
    writer = BucketWriter(max_bytes, out.append)
    for name, tensor in named:
        writer.add(name, tensor)
    writer.flush()
    return writer, out


def test_buckets_are_bounded_ordered_and_complete():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 30, 5, 100, 1])]  # fp32: 4 bytes each
    writer, buckets = write(named, max_bytes=160)
    assert [list(b) for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert all(sum(tensor_bytes(t) for t in b.values()) <= 160 for b in buckets if len(b) > 1)
    assert [(n, t) for b in buckets for n, t in b.items()] == named  # the same tensors, not copies
    assert (writer.num_buckets, writer.num_tensors, writer.num_bytes) == (4, 5, 4 * 146)


def test_a_tensor_larger_than_the_bound_travels_alone():
    named = [("small", torch.zeros(2)), ("big", torch.zeros(100, dtype=torch.bfloat16)), ("tail", torch.zeros(1))]
    _, buckets = write(named, max_bytes=64)
    assert [list(b) for b in buckets] == [["small"], ["big"], ["tail"]]


def test_buckets_go_out_as_they_fill_and_flush_sends_the_rest_once():
    out: list[dict] = []
    writer = BucketWriter(8, out.append)
    writer.add("a", torch.zeros(2))
    assert out == []  # full, but nothing has overflowed it yet
    writer.add("b", torch.zeros(1))
    assert [list(b) for b in out] == [["a"]]
    writer.flush()
    writer.flush()
    assert [list(b) for b in out] == [["a"], ["b"]]


def test_nothing_written_emits_nothing_and_the_bound_must_be_positive():
    writer, buckets = write([], max_bytes=16)
    assert buckets == [] and (writer.num_buckets, writer.num_tensors, writer.num_bytes) == (0, 0, 0)
    with pytest.raises(ValueError, match="positive"):
        BucketWriter(0, print)
