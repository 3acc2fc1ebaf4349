"""The dpo loss against DPO's formula (Rafailov et al. 2023, arXiv:2305.18290, eq. 7) on fixed float64
tensors, value and gradient, with NeMo-RL's SFT term and averaged variants; and the learner's plan
keeping every (chosen, rejected) pair in one micro-batch however the step is split."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.registry import loss_for_run, make_loss
from rlserve.config import SpecError, parse_spec
from rlserve.config.algorithms import DpoCfg
from rlserve.training.batch import TrainBatch
from rlserve.training.objective import StepObjective

F64 = torch.float64
# Two pairs: (chosen 2 tokens, rejected 3 tokens), (chosen 1 token, rejected 2 tokens, one masked).
SEQ = [0, 0, 1, 1, 1, 2, 3, 3]
CURR = [-0.5, -1.0, -0.7, -2.0, -0.1, -0.3, -1.5, -0.9]
REF = [-0.6, -1.2, -0.5, -1.5, -0.2, -0.8, -1.0, -0.4]
MASK = [1, 1, 1, 1, 1, 1, 1, 0]


def dpo(cfg: DpoCfg) -> tuple[float, list[float], dict]:
    curr = torch.tensor(CURR, dtype=F64, requires_grad=True)
    inputs = LossInputs(curr, None, None, torch.tensor(REF, dtype=F64), torch.zeros(8, dtype=F64),
                        torch.tensor(MASK, dtype=F64), torch.tensor(SEQ), 4)
    loss, metrics = make_loss("dpo", cfg)(inputs, 4.0)  # the step's normaliser: 4 sequences
    loss.backward()
    return loss.item(), curr.grad.tolist(), metrics


def formula(cfg: DpoCfg) -> tuple[float, list[float]]:
    """Per pair: -log sigmoid(beta (h_w - h_l)) + sft_weight * NLL(chosen), h = sum (or mean) of log pi - log pi_ref
    over the response; the mean over pairs. The gradient of each token's logprob by hand."""
    beta = cfg.reference_policy_kl_penalty
    seqs: dict[int, list[int]] = {}
    for t, (s, m) in enumerate(zip(SEQ, MASK)):
        if m:
            seqs.setdefault(s, []).append(t)
    loss, grad = 0.0, [0.0] * len(CURR)
    for p in range(2):
        w, lose = seqs[2 * p], seqs[2 * p + 1]
        norm_w = len(w) if cfg.preference_average_log_probs else 1
        norm_l = len(lose) if cfg.preference_average_log_probs else 1
        h_w = sum(CURR[t] - REF[t] for t in w) / norm_w
        h_l = sum(CURR[t] - REF[t] for t in lose) / norm_l
        margin = beta * (h_w - h_l)
        sft_norm = len(w) if cfg.sft_average_log_probs else 1
        nll = -sum(CURR[t] for t in w) / sft_norm
        loss += (cfg.preference_loss_weight * -math.log(1 / (1 + math.exp(-margin))) + cfg.sft_loss_weight * nll) / 2
        d_margin = -(1 - 1 / (1 + math.exp(-margin)))  # d(-log sigmoid(m)) / dm
        for t in w:
            grad[t] += (cfg.preference_loss_weight * d_margin * beta / norm_w - cfg.sft_loss_weight / sft_norm) / 2
        for t in lose:
            grad[t] -= cfg.preference_loss_weight * d_margin * beta / norm_l / 2
    return loss, grad


@pytest.mark.parametrize("keys", [
    {},
    {"reference_policy_kl_penalty": 0.5},
    {"sft_loss_weight": 0.3},
    {"preference_average_log_probs": True, "sft_average_log_probs": True, "sft_loss_weight": 1.0},
    {"preference_loss_weight": 0.0, "sft_loss_weight": 1.0},
])
def test_dpo_matches_the_formula_with_its_gradient(keys):
    cfg = DpoCfg(**keys)
    loss, grad, metrics = dpo(cfg)
    expected_loss, expected_grad = formula(cfg)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert grad == pytest.approx(expected_grad, abs=1e-6)
    assert metrics["pair_count"].item() == 2


def test_at_the_reference_the_loss_is_log_2_and_accuracy_counts_positive_margins():
    cfg = DpoCfg(reference_policy_kl_penalty=1.0)
    curr = torch.tensor(REF, dtype=F64)
    inputs = LossInputs(curr, None, None, torch.tensor(REF, dtype=F64), torch.zeros(8, dtype=F64),
                        torch.tensor(MASK, dtype=F64), torch.tensor(SEQ), 4)
    loss, metrics = make_loss("dpo", cfg)(inputs, 4.0)
    assert loss.item() == pytest.approx(math.log(2))
    assert metrics["accuracy_count"].item() == 0 and metrics["margin_sum"].item() == 0
    _, _, moved = dpo(cfg)  # pair 0: h_w = 0.3, h_l = -0.6 (margin > 0); pair 1: h_w = 0.5, h_l = -0.5
    assert moved["accuracy_count"].item() == 2


def step_loss(batch: TrainBatch, spec_keys: dict, dp_size: int) -> tuple[float, list[list[int]]]:
    """The step's loss summed over every rank's micro-batches, and each micro-batch's sequences (known by
    their reference logprobs, -0.1 (i + 1) at the first token). Each token's current logprob is twice its
    reference one, so it does not depend on where the plan puts it."""
    spec = parse_spec({"algorithm": "dpo", "data": {"task": "jsonl", "train_path": "p.jsonl"}, "policy": {
        "max_total_sequence_length": 8, "generation": {"max_new_tokens": 4}, **spec_keys}})
    total, placed = 0.0, []
    for rank in range(dp_size):
        objective = StepObjective(spec, batch, "dpo", dp_size=dp_size, dp_rank=rank, pad_id=0)
        for mb in objective.plans[0]:
            firsts = [mb.ref_logprobs[mb.seq_index == j][0].item() for j in range(mb.num_seqs)]
            placed.append([round(-f / 0.1) - 1 for f in firsts])
            total += objective.micro_batch_loss(0, mb, 2 * mb.ref_logprobs, None).item()
    return total, [p for p in placed if p]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dp_size, micro_batch_size", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_pairs_stay_whole_however_the_step_is_split(packed, dp_size, micro_batch_size):
    """Every micro-batch holds whole pairs, chosen first, and the losses add up to the step's in one piece."""
    lengths = [(3, 2), (3, 4), (2, 1), (2, 5), (4, 2), (4, 2)]  # (prompt, response) of 3 pairs
    seqs = [[5 + k for k in range(p + c)] for p, c in lengths]
    ref = [[-0.1 * (i + 1) - 0.01 * k for k in range(c)] for i, (_, c) in enumerate(lengths)]
    batch = TrainBatch.from_sequences(seqs, [p for p, _ in lengths], None, None, ref)
    split, placed = step_loss(batch, {"train_micro_batch_size": micro_batch_size, "sequence_packing": {
        "enabled": packed, "train_mb_tokens": 16}}, dp_size)
    whole, _ = step_loss(batch, {"train_micro_batch_size": 6}, 1)
    assert split == pytest.approx(whole, abs=1e-6)
    assert sorted(i for p in placed for i in p) == list(range(6))
    assert all(p[k] % 2 == 0 and p[k + 1] == p[k] + 1 for p in placed for k in range(0, len(p), 2))


def test_the_spec_asks_for_preference_files_and_refuses_an_empty_loss():
    for data, field in [({"algorithm": "dpo"}, "data.task"),
                        ({"algorithm": "dpo", "data": {"task": "jsonl", "train_path": "p.jsonl"},
                          "dpo": {"preference_loss_weight": 0}}, "dpo.preference_loss_weight")]:
        with pytest.raises(SpecError) as err:
            parse_spec(data)
        assert err.value.problems[0].startswith(field + ":"), err.value.problems
    spec = parse_spec({"algorithm": "dpo", "data": {"task": "jsonl", "train_path": "p.jsonl"},
                       "dpo": {"reference_policy_kl_penalty": 0.2}})
    assert loss_for_run("dpo", spec).cfg.reference_policy_kl_penalty == 0.2
