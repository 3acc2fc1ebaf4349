"""Micro-batching and packing: flat per-token vectors line up with the completion tokens."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlserve.training.batch import TrainBatch, rank_micro_batches
from rlserve.training.forward import completion_positions
from rlserve.training.packing import first_fit_decreasing


def make_batch(lengths: list[tuple[int, int]]) -> TrainBatch:
    seqs, prompts, gen = [], [], []
    for i, (p, c) in enumerate(lengths):
        seqs.append([(i * 7 + k) % 50 + 3 for k in range(p + c)])
        prompts.append(p)
        gen.append([-(i + 1) - k / 100 for k in range(c)])
    return TrainBatch.from_sequences(seqs, prompts, [float(i) for i in range(len(lengths))], gen)


def test_first_fit_decreasing_respects_capacity():
    bins = first_fit_decreasing([5, 9, 3, 7, 1, 4], 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum([5, 9, 3, 7, 1, 4][i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3


LENGTHS = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, packed=st.booleans(), dp=st.integers(1, 3), mbs=st.integers(1, 4))
def test_every_completion_token_appears_once_with_its_values(lengths, packed, dp, mbs):
    batch = make_batch(lengths)
    idx = list(range(batch.num_seqs))
    seen_gen, seen_adv = [], []
    counts = []
    for rank in range(dp):
        mbs_ = rank_micro_batches(batch, idx, rank, dp, packed=packed, micro_batch_size=mbs, mb_tokens=16)
        counts.append(len(mbs_))
        for mb in mbs_:
            n = int(mb.completion_mask.sum())
            assert n == mb.gen_logprobs.numel() == mb.advantages.numel() == mb.seq_index.numel()
            # Targets of the selected hidden positions are exactly the completion tokens.
            assert torch.equal(mb.input_ids[:, 1:][completion_positions(mb.completion_mask)[:, :-1]],
                               mb.input_ids[mb.completion_mask])
            seen_gen += mb.gen_logprobs.tolist()
            seen_adv += mb.advantages.tolist()
            if packed:
                assert mb.attention_mask is None and int(mb.input_ids.numel()) <= 16
    assert len(set(counts)) == 1, "every rank must run the same number of micro-batches"
    assert sorted(seen_gen) == sorted(batch.gen_logprobs.tolist())
    assert sorted(seen_adv) == sorted(a for (_, c), a in zip(lengths, range(len(lengths))) for _ in range(c))


def test_packed_positions_restart_per_sequence():
    batch = make_batch([(2, 2), (3, 1)])
    (mb,) = rank_micro_batches(batch, [0, 1], 0, 1, packed=True, micro_batch_size=8, mb_tokens=16)
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


def test_bad_sequences_are_rejected():
    import pytest

    with pytest.raises(ValueError, match="prompt_length"):
        TrainBatch.from_sequences([[1, 2]], [2])
    with pytest.raises(ValueError, match="generator_logprobs"):
        TrainBatch.from_sequences([[1, 2, 3]], [1], [0.0], [[-1.0]])


@settings(max_examples=40, deadline=None)
@given(lengths=LENGTHS, dp=st.integers(1, 3))
def test_packed_micro_batches_carry_their_sequence_bounds(lengths, dp):
    batch = make_batch(lengths)
    for rank in range(dp):
        for mb in rank_micro_batches(batch, list(range(batch.num_seqs)), rank, dp, packed=True,
                                     micro_batch_size=8, mb_tokens=16):
            starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
            assert mb.cu_seqlens.tolist() == starts + [mb.input_ids.shape[1]]
            assert mb.max_seqlen == int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max())
            assert mb.attention_kwargs()["cu_seq_lens_q"] is mb.cu_seqlens


def test_packed_ranks_are_balanced_by_tokens():
    # Strided dealing would give rank 0 the three long sequences (36 tokens) and rank 1 six.
    batch = make_batch([(6, 6), (1, 1), (6, 6), (1, 1), (6, 6), (1, 1)])
    loads = [sum(mb.num_tokens for mb in rank_micro_batches(batch, list(range(6)), r, 2, packed=True,
                                                             micro_batch_size=8, mb_tokens=24))
             for r in range(2)]
    assert loads == [24, 18]  # the best split of three 12s and three 2s
