"""Micro-batching and packing: flat per-token vectors line up with the completion tokens."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlserve.training.batch import TrainBatch, rank_micro_batches
from rlserve.training.forward import completion_positions
from rlserve.training.packing import PACKERS, balanced, first_fit_decreasing, get_packer


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


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), capacity=st.integers(40, 120))
def test_balanced_bins_are_as_many_as_ffd_and_no_fuller(lengths, capacity):
    ffd, even = first_fit_decreasing(lengths, capacity), balanced(lengths, capacity)
    assert sorted(i for b in even for i in b) == list(range(len(lengths)))
    assert len(even) <= len(ffd)

    def fullest(bins):
        return max(sum(lengths[i] for i in b) for b in bins)

    assert fullest(even) <= capacity and fullest(even) <= fullest(ffd)


def test_balanced_spreads_a_long_tail():
    # FFD fills two bins to the brim and leaves the third half empty.
    lengths = [20, 20, 20, 20, 20, 5, 5]
    assert [sum(lengths[i] for i in b) for b in first_fit_decreasing(lengths, 45)] == [45, 45, 20]
    assert [sum(lengths[i] for i in b) for b in balanced(lengths, 45)] == [40, 40, 30]


def test_unknown_packing_algorithm_names_the_valid_ones():
    import pytest

    with pytest.raises(ValueError, match="first_fit_decreasing, balanced"):
        get_packer("best_fit")


ALGORITHMS = st.sampled_from(sorted(PACKERS))
LENGTHS = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, packed=st.booleans(), dp=st.integers(1, 3), mbs=st.integers(1, 4), algorithm=ALGORITHMS)
def test_every_completion_token_appears_once_with_its_values(lengths, packed, dp, mbs, algorithm):
    batch = make_batch(lengths)
    idx = list(range(batch.num_seqs))
    seen_gen, seen_adv = [], []
    counts = []
    for rank in range(dp):
        mbs_ = rank_micro_batches(batch, idx, rank, dp, packed=packed, micro_batch_size=mbs, mb_tokens=16,
                                  algorithm=algorithm)
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


@settings(max_examples=40, deadline=None)
@given(lengths=LENGTHS, packed=st.booleans(), dp=st.integers(1, 3), mbs=st.integers(1, 4))
def test_token_advantages_follow_their_tokens(lengths, packed, dp, mbs):
    """A token-level estimator's advantages (REINFORCE++) line up with the generator logprobs, token by token."""
    base = make_batch(lengths)
    token_adv = [[10.0 * i + k for k in range(c)] for i, (_, c) in enumerate(lengths)]
    batch = TrainBatch.from_sequences([base.sequence(i).tolist() for i in range(base.num_seqs)],
                                      base.prompt_lens.tolist(), None,
                                      [[-(i + 1) - k / 100 for k in range(c)] for i, (_, c) in enumerate(lengths)],
                                      token_advantages=token_adv)
    pairs = []
    for rank in range(dp):
        for mb in rank_micro_batches(batch, list(range(batch.num_seqs)), rank, dp, packed=packed,
                                     micro_batch_size=mbs, mb_tokens=16, algorithm="balanced"):
            assert mb.advantages.numel() == mb.gen_logprobs.numel()
            pairs += zip(mb.gen_logprobs.tolist(), mb.advantages.tolist())
    expected = [(-(i + 1) - k / 100, 10.0 * i + k) for i, (_, c) in enumerate(lengths) for k in range(c)]
    assert sorted((round(g, 4), a) for g, a in pairs) == sorted((round(g, 4), a) for g, a in expected)


def test_packed_positions_restart_per_sequence():
    batch = make_batch([(2, 2), (3, 1)])
    (mb,) = rank_micro_batches(batch, [0, 1], 0, 1, packed=True, micro_batch_size=8, mb_tokens=16,
                              algorithm="balanced")
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
                                     micro_batch_size=8, mb_tokens=16, algorithm="balanced"):
            starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
            assert mb.cu_seqlens.tolist() == starts + [mb.input_ids.shape[1]]
            assert mb.max_seqlen == int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max())
            assert mb.attention_kwargs()["cu_seq_lens_q"] is mb.cu_seqlens


def test_packed_ranks_are_balanced_by_tokens():
    # Strided dealing would give rank 0 the three long sequences (36 tokens) and rank 1 six.
    batch = make_batch([(6, 6), (1, 1), (6, 6), (1, 1), (6, 6), (1, 1)])
    loads = [sum(mb.num_tokens for mb in rank_micro_batches(batch, list(range(6)), r, 2, packed=True,
                                                             micro_batch_size=8, mb_tokens=24,
                                                             algorithm="balanced"))
             for r in range(2)]
    assert loads == [24, 18]  # the best split of three 12s and three 2s


def test_ages_turns_and_routes_follow_their_tokens_into_micro_batches():
    """Per-token ages and turns line up with the flat completion vectors; routed experts with input_ids,
    -1 over padding (the learner routes it itself)."""
    seqs, prompts = [[5, 6, 7, 8], [5, 6, 7], [9, 9, 9, 9, 9]], [2, 1, 3]
    ages = [[0, 1], [2, 2], [0, 0]]
    turns = [[1, 2], [1, 1], [1, 0]]
    routes = [torch.arange(len(s) * 4, dtype=torch.int16).view(len(s), 2, 2) + 100 * i for i, s in enumerate(seqs)]
    coded = [[10.0 * a + t for a, t in zip(ar, tr)] for ar, tr in zip(ages, turns)]  # gen logprobs name them
    batch = TrainBatch.from_sequences(seqs, prompts, [0.0, 0.0, 0.0], coded, token_ages=ages, token_turns=turns,
                                      routed_experts=routes)
    for packed in (False, True):
        (mb,) = rank_micro_batches(batch, [0, 1, 2], 0, 1, packed=packed, micro_batch_size=3, mb_tokens=64,
                                   algorithm="balanced")
        assert (mb.token_ages * 10 + mb.token_turns).float().tolist() == mb.gen_logprobs.tolist()
        got = mb.routed_experts
        assert got.shape[:2] == mb.input_ids.shape and got.shape[2:] == (2, 2)
        # Every row's routes are its own sequence's (they encode 100 * sequence + position).
        rows = got.flatten(0, 1)[(mb.input_ids.flatten() != 0) & (got.flatten(0, 1)[:, 0, 0] >= 0)]
        assert len(rows) == sum(len(s) for s in seqs)
        if not packed:
            assert (got[1, 3:] == -1).all()  # padding
