"""The cispo loss against MiniMax-M1's formula (arXiv:2506.13585, eq. 4) on fixed float64 tensors,
value and gradient, built by name as the learner builds it."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.registry import make_loss
from rlserve.config import SpecError, parse_spec
from rlserve.config.algorithms import LossFnCfg

F64 = torch.float64
# Two sequences: 3 tokens (one masked) and 2 tokens.
CURR = [-0.5, -1.2, -0.1, -2.0, -0.7]
PREV = [-0.9, -1.0, -0.3, -1.1, -0.7]  # ratios e^0.4 = 1.49 (above 1.2), e^-0.2 = 0.82, e^-0.9 = 0.41 (below 0.8), 1
GEN = [-1.0, -0.8, -0.3, -1.0, -1.5]
REF = [-0.6, -1.1, -0.2, -1.9, -0.4]
ADV = [1.5, 1.5, 1.5, -0.5, -0.5]
MASK = [1.0, 1.0, 0.0, 1.0, 1.0]
SEQ = [0, 0, 0, 1, 1]


def cispo(cfg: LossFnCfg) -> tuple[float, list[float], dict]:
    curr = torch.tensor(CURR, dtype=F64, requires_grad=True)
    inputs = LossInputs(curr, torch.tensor(PREV, dtype=F64), torch.tensor(GEN, dtype=F64),
                        torch.tensor(REF, dtype=F64), torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64),
                        torch.tensor(SEQ), 2)
    loss, metrics = make_loss("cispo", cfg)(inputs, sum(MASK))
    loss.backward()
    return loss.item(), curr.grad.tolist(), metrics


def formula(cfg: LossFnCfg) -> tuple[float, list[float]]:
    """The paper's objective, token by token in Python floats: -sg(clip(r)) A log pi (times the truncated
    generator weight when on) + beta * KL, over the valid tokens; d/dlog pi of each term by hand."""
    n = sum(MASK)
    loss, grad = 0.0, []
    for c, p, g, r_, a, m in zip(CURR, PREV, GEN, REF, ADV, MASK):
        if not m:
            grad.append(0.0)
            continue
        weight = min(max(math.exp(c - p), 1 - cfg.ratio_clip_min), 1 + cfg.ratio_clip_max)
        w = min(math.exp(p - g), cfg.truncated_importance_sampling_ratio) \
            if cfg.use_importance_sampling_correction else 1.0
        beta = cfg.reference_policy_kl_penalty
        log_x = r_ - c  # k3 = x - 1 - log x
        loss += (-weight * a * c * w + beta * (math.exp(log_x) - 1 - log_x)) / n
        grad.append((-weight * a * w + beta * (1 - math.exp(log_x))) / n)
    return loss, grad


@pytest.mark.parametrize("keys", [
    {},
    {"ratio_clip_min": 1.0, "ratio_clip_max": 5.0},  # MiniMax-M1's: no lower bound
    {"ratio_clip_min": 0.1, "ratio_clip_max": 0.3},
    {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.5},
    {"reference_policy_kl_penalty": 0.2},
])
def test_cispo_matches_the_formula_with_its_gradient(keys):
    cfg = LossFnCfg(name="cispo", **keys)
    loss, grad, _ = cispo(cfg)
    expected_loss, expected_grad = formula(cfg)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert grad == pytest.approx(expected_grad, abs=1e-6)


def test_a_clipped_token_keeps_its_gradient_where_ppo_clipping_zeroes_it():
    # Token 0: A > 0 and r = e^0.4 above 1.2. GRPO's clipped surrogate gives it no gradient; CISPO gives it
    # -clip(r) A / n = -1.2 * 1.5 / 4.
    _, grad, metrics = cispo(LossFnCfg(name="cispo"))
    assert grad[0] == pytest.approx(-1.2 * 1.5 / 4, abs=1e-12)
    curr = torch.tensor(CURR, dtype=F64, requires_grad=True)
    grpo_inputs = LossInputs(curr, torch.tensor(PREV, dtype=F64), torch.tensor(GEN, dtype=F64), None,
                             torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64), torch.tensor(SEQ), 2)
    make_loss("grpo", LossFnCfg())(grpo_inputs, 4.0)[0].backward()
    assert curr.grad[0].item() == 0.0
    # Clipped: token 0 (above 1.2) and token 3 (e^-0.9 below 0.8); the masked token is not counted.
    assert metrics["clip_count"].item() == 2 and metrics["token_count"].item() == 4


@pytest.mark.parametrize("keys, field", [
    ({"ratio_clip_c": 3.0}, "loss_fn.ratio_clip_c"),
    ({"token_level_loss": False}, "loss_fn.token_level_loss"),
    ({"sequence_level_importance_ratios": True, "token_level_loss": False}, "loss_fn.sequence_level_importance_ratios"),
])
def test_the_spec_refuses_what_cispo_does_not_define(keys, field):
    with pytest.raises(SpecError) as err:
        parse_spec({"loss_fn": {"name": "cispo", **keys}})
    assert err.value.problems[0].startswith(field + ":")


def test_nemo_rl_use_cispo_names_the_loss():
    from rlserve.config import load_spec, spec_to_yaml

    spec = parse_spec({"loss_fn": {"use_cispo": True, "ratio_clip_min": 1.0, "ratio_clip_max": 5.0}})
    assert spec.loss_fn.name == "cispo" and load_spec(spec_to_yaml(spec)) == spec
    assert parse_spec({"loss_fn": {"use_cispo": False}}).loss_fn.name == "grpo"
    with pytest.raises(SpecError) as err:
        parse_spec({"loss_fn": {"use_cispo": True, "name": "grpo"}})
    assert err.value.problems[0].startswith("loss_fn.use_cispo:")
