"""GRPO / SFT losses: hand-computed cases, a float64 loop reference, split invariance.

The losses are called as the learner calls them: built by name from the registry.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.metrics import finalize_metrics, reduce_metric_sums
from rlserve.algorithms.registry import make_loss
from rlserve.config.spec import LossFnCfg

F64 = torch.float64
LN = math.log


def grpo_loss(curr, prev, gen, ref, adv, mask, seq_index, num_seqs, cfg: LossFnCfg, normalizer):
    return make_loss("grpo", cfg)(LossInputs(curr, prev, gen, ref, adv, mask, seq_index, num_seqs), normalizer)


def run(curr, adv, cfg, prev=None, gen=None, ref=None, mask=None, seq_index=None, normalizer=None):
    """grpo_loss on float64 lists; defaults: prev = gen = 0, every token valid, one token per sequence."""
    n = len(curr)
    curr_t = torch.tensor(curr, dtype=F64, requires_grad=True)
    prev_t = torch.tensor(prev if prev is not None else [0.0] * n, dtype=F64)
    gen_t = torch.tensor(gen, dtype=F64) if gen is not None else prev_t.clone()
    ref_t = torch.tensor(ref, dtype=F64) if ref is not None else None
    mask_t = torch.tensor(mask if mask is not None else [1.0] * n, dtype=F64)
    seq_t = torch.tensor(seq_index if seq_index is not None else list(range(n)))
    num_seqs = int(seq_t.max()) + 1
    if normalizer is None:
        normalizer = float(mask_t.sum()) if cfg.token_level_loss else float(num_seqs)
    loss, metrics = grpo_loss(curr_t, prev_t, gen_t, ref_t, torch.tensor(adv, dtype=F64), mask_t, seq_t,
                              num_seqs, cfg, normalizer)
    loss.backward()
    return loss.item(), curr_t.grad.tolist(), metrics


def close(got, expected, tol=1e-9):
    assert got == pytest.approx(expected, abs=tol, rel=tol)


# ---------------------------------------------------------------- clipping


def test_ppo_clip_on_both_sides():
    cfg = LossFnCfg()  # clip range [0.8, 1.2]
    ratios = [1.5, 0.5, 1.5, 0.5, 1.1]
    adv = [1.0, 1.0, -1.0, -1.0, 2.0]
    # Per token: A>0 r>1.2 -> -1.2 (clipped, no grad); A>0 r<0.8 -> -0.5 (grad -A r);
    # A<0 r>1.2 -> 1.5 (grad -A r = 1.5); A<0 r<0.8 -> 0.8 (clipped); inside -> -2.2.
    loss, grad, m = run([LN(r) for r in ratios], adv, cfg)
    close(loss, (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5)
    close(grad, [0.0, -0.5 / 5, 1.5 / 5, 0.0, -2.2 / 5])
    assert m["clip_count"].item() == 2
    assert m["dual_clip_count"].item() == 0


def test_asymmetric_clip_range():
    cfg = LossFnCfg(ratio_clip_min=0.1, ratio_clip_max=0.3)  # [0.9, 1.3]
    loss, grad, m = run([LN(1.25), LN(0.85)], [1.0, -1.0], cfg)
    # 1.25 is inside the raised upper bound; 0.85 with A<0 is below 0.9 -> -A * 0.9 = 0.9.
    close(loss, (-1.25 + 0.9) / 2)
    close(grad, [-1.25 / 2, 0.0])
    assert m["clip_count"].item() == 1


def test_dual_clip_caps_negative_advantages():
    cfg = LossFnCfg(ratio_clip_c=3.0)
    loss, grad, m = run([LN(5.0), LN(2.0), LN(5.0)], [-1.0, -1.0, 1.0], cfg)
    # A<0, r=5: max(5, 1.2) = 5 capped at c|A| = 3; r=2 below c: 2; A>0: dual clip never applies: -1.2.
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(grad, [0.0, 2.0 / 3, 0.0])
    assert m["dual_clip_count"].item() == 1
    assert m["clip_count"].item() == 1


# ---------------------------------------------------------------- KL to the reference


@pytest.mark.parametrize(("kl_type", "value", "grad"), [
    # log x = log pi_ref - log pi_curr = log 0.5.
    ("k1", -LN(0.5), 1.0),
    ("k2", 0.5 * LN(0.5) ** 2, -LN(0.5)),
    ("k3", 0.5 - 1.0 - LN(0.5), 1.0 - 0.5),
])
def test_kl_types(kl_type, value, grad):
    cfg = LossFnCfg(reference_policy_kl_penalty=0.25, reference_policy_kl_type=kl_type)
    curr, ref = LN(0.5), LN(0.25)
    # prev = curr and A = 0: the policy-gradient term is 0 and only beta * KL is left.
    loss, g, m = run([curr], [0.0], cfg, prev=[curr], ref=[ref])
    close(loss, 0.25 * value)
    close(g, [0.25 * grad])
    close(m["kl_sum"].item(), value, tol=1e-6)
    close(m["kl_loss_sum"].item(), 0.25 * value, tol=1e-6)


@pytest.mark.parametrize(("kl_type", "log_x", "input_clamp", "output_clamp", "expected"), [
    ("k3", -30.0, 20.0, 10.0, 10.0),                       # e^-20 + 19 -> clamped to 10
    ("k3", -30.0, 20.0, None, math.exp(-20.0) + 19.0),
    ("k3", -30.0, None, None, math.exp(-30.0) + 29.0),
    ("k1", 30.0, None, 10.0, -10.0),                       # the output clamp is symmetric
    ("k2", 30.0, 20.0, None, 200.0),
    ("k2", -4.0, 20.0, 10.0, 8.0),                         # inside both clamps
])
def test_kl_clamps(kl_type, log_x, input_clamp, output_clamp, expected):
    cfg = LossFnCfg(reference_policy_kl_penalty=1.0, reference_policy_kl_type=kl_type,
                    kl_input_clamp_value=input_clamp, kl_output_clamp_value=output_clamp)
    loss, grad, _ = run([0.0], [0.0], cfg, ref=[log_x])
    close(loss, expected)
    clamped = (input_clamp is not None and abs(log_x) > input_clamp) or (
        output_clamp is not None and abs(expected) >= output_clamp)
    if clamped:
        close(grad, [0.0])
    else:
        assert grad[0] != 0.0


def test_on_policy_kl_approximation_reweights_by_curr_over_gen():
    cfg = LossFnCfg(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1",
                    use_on_policy_kl_approximation=True)
    curr, gen, ref = LN(0.5), LN(0.25), LN(0.125)
    loss, grad, _ = run([curr], [0.0], cfg, prev=[curr], gen=[gen], ref=[ref])
    # k1 = log 0.5 - log 0.125 = log 4, weight pi_curr / pi_gen = 2 (detached: the gradient is 2 * dk1 = 2).
    close(loss, 2.0 * LN(4.0))
    close(grad, [2.0])


def test_kl_penalty_needs_reference_logprobs():
    with pytest.raises(ValueError, match="reference"):
        run([0.0], [1.0], LossFnCfg(reference_policy_kl_penalty=0.1))


# ---------------------------------------------------------------- importance sampling


def is_case(weights, cfg):
    """r = 1 (curr = prev = 0), A = 1, gen chosen so that pi_prev / pi_gen = w: token loss -w_used."""
    n = len(weights)
    return run([0.0] * n, [1.0] * n, cfg, gen=[-LN(w) for w in weights])


def test_tis_truncates_large_weights():
    cfg = LossFnCfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0)
    loss, grad, m = is_case([0.5, 1.5, 3.0], cfg)
    close(loss, -(0.5 + 1.5 + 2.0) / 3)
    close(grad, [-0.5 / 3, -1.5 / 3, -2.0 / 3])
    assert m["is_truncated_count"].item() == 1
    # The metrics report the weights before truncation.
    close(m["is_weight_max"].item(), 3.0, tol=1e-6)
    close(m["is_weight_min"].item(), 0.5, tol=1e-6)
    close(m["is_weight_sum"].item(), 5.0, tol=1e-6)


def test_icepop_masks_weights_outside_the_band():
    cfg = LossFnCfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
                    truncated_importance_sampling_type="icepop")
    # Band [1/2, 2]: 0.4 and 3.0 leave it.
    loss, grad, m = is_case([0.4, 0.5, 1.5, 2.0, 3.0], cfg)
    close(loss, -(0.5 + 1.5 + 2.0) / 5)
    close(grad, [0.0, -0.5 / 5, -1.5 / 5, -2.0 / 5, 0.0])
    assert m["is_truncated_count"].item() == 2
    cfg = cfg.model_copy(update={"truncated_importance_sampling_ratio_min": 0.3})
    loss, _, m = is_case([0.4, 0.5, 1.5, 2.0, 3.0], cfg)
    close(loss, -(0.4 + 0.5 + 1.5 + 2.0) / 5)
    assert m["is_truncated_count"].item() == 1


def test_no_truncation_and_no_correction():
    untruncated = LossFnCfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=None)
    loss, _, m = is_case([0.5, 3.0], untruncated)
    close(loss, -(0.5 + 3.0) / 2)
    assert m["is_truncated_count"].item() == 0
    off = LossFnCfg(use_importance_sampling_correction=False)
    loss, _, m = is_case([0.5, 3.0], off)
    close(loss, -1.0)
    close(m["is_weight_max"].item(), 3.0, tol=1e-6)  # still measured
    assert m["is_truncated_count"].item() == 0


def test_sequence_level_importance_weight_is_the_geometric_mean():
    cfg = LossFnCfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=None,
                    sequence_level_importance_ratios=True, token_level_loss=False)
    # Sequence 0: valid log w = log 2, log 0.5, log 4 -> w = 4^(1/3); the masked log 100 does not count.
    # Sequence 1: w = 3. r = 1, A = 1: sequence loss -w; two sequences.
    log_w = [LN(2.0), LN(0.5), LN(100.0), LN(4.0), LN(3.0)]
    loss, grad, _ = run([0.0] * 5, [1.0] * 5, cfg, gen=[-x for x in log_w], mask=[1, 1, 0, 1, 1],
                        seq_index=[0, 0, 0, 0, 1])
    w0 = 4.0 ** (1 / 3)
    close(loss, -(w0 + 3.0) / 2)
    # Token level instead: each token keeps its own weight.
    token_cfg = cfg.model_copy(update={"sequence_level_importance_ratios": False})
    loss, _, _ = run([0.0] * 5, [1.0] * 5, token_cfg, gen=[-x for x in log_w], mask=[1, 1, 0, 1, 1],
                     seq_index=[0, 0, 0, 0, 1])
    close(loss, -((2.0 + 0.5 + 4.0) / 3 + 3.0) / 2)


def test_sequence_level_ratio_is_gspo():
    cfg = LossFnCfg(sequence_level_importance_ratios=True, token_level_loss=False)
    # Geometric mean ratio (2 * 0.5 * 1.21)^(1/3) = 1.21^(1/3), inside the clip range;
    # d r / d curr_t = r / 3 for each token, A = 1, one sequence.
    r = 1.21 ** (1 / 3)
    loss, grad, _ = run([LN(2.0), LN(0.5), LN(1.21)], [1.0] * 3, cfg, seq_index=[0, 0, 0])
    close(loss, -r)
    close(grad, [-r / 3] * 3)
    # 4^(1/3) = 1.587 > 1.2: the whole sequence is clipped, though two of its tokens have ratio 1.
    loss, grad, m = run([LN(4.0), 0.0, 0.0], [1.0] * 3, cfg, seq_index=[0, 0, 0])
    close(loss, -1.2)
    close(grad, [0.0] * 3)
    assert m["clip_count"].item() == 3


# ---------------------------------------------------------------- normalisation


def test_token_versus_sequence_normalisation():
    # r = 1, per-token loss -A; sequence 0 has tokens A = 1, 3, sequence 1 one token A = 5.
    kwargs = dict(seq_index=[0, 0, 1])
    loss, _, _ = run([0.0] * 3, [1.0, 3.0, 5.0], LossFnCfg(token_level_loss=True), **kwargs)
    close(loss, -(1 + 3 + 5) / 3)
    loss, _, _ = run([0.0] * 3, [1.0, 3.0, 5.0], LossFnCfg(token_level_loss=False), **kwargs)
    close(loss, -((1 + 3) / 2 + 5) / 2)


def test_masked_garbage_does_not_leak():
    cfg = LossFnCfg(reference_policy_kl_penalty=0.1, use_importance_sampling_correction=True,
                    use_on_policy_kl_approximation=True, token_level_loss=False,
                    sequence_level_importance_ratios=True)
    nan, inf = float("nan"), float("inf")
    loss, grad, m = run([0.1, -inf, nan], [1.0, nan, 2.0], cfg, prev=[0.0, -inf, 0.0], gen=[0.0, nan, -inf],
                        ref=[0.0, inf, nan], mask=[1, 0, 0], seq_index=[0, 0, 1], normalizer=1.0)
    assert math.isfinite(loss) and all(math.isfinite(g) for g in grad)
    assert grad[1] == 0.0 and grad[2] == 0.0
    assert all(torch.isfinite(v) for v in m.values())
    assert m["seq_count"].item() == 1 and m["token_count"].item() == 1


# ---------------------------------------------------------------- float64 loop reference


def loop_grpo_loss(curr, prev, gen, ref, adv, mask, seq_index, cfg: LossFnCfg, normalizer):
    """Token by token, sequence by sequence; curr is a float64 tensor (grad flows), the rest lists."""
    lo, hi = 1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max
    beta = cfg.reference_policy_kl_penalty
    total = torch.zeros((), dtype=F64)
    for s in sorted(set(seq_index)):
        toks = [t for t in range(len(seq_index)) if seq_index[t] == s and mask[t] > 0]
        if not toks:
            continue
        seq_log_r = sum(curr[t] - prev[t] for t in toks) / len(toks)
        seq_log_w = sum(prev[t] - gen[t] for t in toks) / len(toks)
        losses = []
        for t in toks:
            seq_level = cfg.sequence_level_importance_ratios
            r = torch.exp(seq_log_r if seq_level else curr[t] - prev[t])
            a = adv[t]
            r_clip = r if lo <= r.item() <= hi else torch.tensor(lo if r.item() < lo else hi, dtype=F64)
            pg = -a * r if -a * r.item() >= -a * r_clip.item() else -a * r_clip
            if cfg.ratio_clip_c is not None and a < 0 and pg.item() > -a * cfg.ratio_clip_c:
                pg = torch.tensor(-a * cfg.ratio_clip_c, dtype=F64)
            w = math.exp(seq_log_w if seq_level else prev[t] - gen[t])
            cap = cfg.truncated_importance_sampling_ratio
            if cap is not None and cfg.truncated_importance_sampling_type == "tis":
                w = min(w, cap)
            elif cap is not None:
                floor = cfg.truncated_importance_sampling_ratio_min or 1.0 / cap
                w = w if floor <= w <= cap else 0.0
            if not cfg.use_importance_sampling_correction:
                w = 1.0
            kl = 0.0
            if beta > 0:
                log_x = ref[t] - curr[t]
                if cfg.kl_input_clamp_value is not None:
                    c = cfg.kl_input_clamp_value
                    log_x = log_x.clamp(-c, c)
                kl = {"k1": -log_x, "k2": log_x ** 2 / 2, "k3": torch.exp(log_x) - 1 - log_x}[cfg.reference_policy_kl_type]
                if cfg.kl_output_clamp_value is not None:
                    c = cfg.kl_output_clamp_value
                    kl = kl.clamp(-c, c)
                if cfg.use_on_policy_kl_approximation:
                    kl = kl * math.exp(curr[t].item() - gen[t])
            losses.append(w * pg + beta * kl)
        total = total + (sum(losses) if cfg.token_level_loss else sum(losses) / len(losses)) / normalizer
    return total


def random_batch(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    seq_index = [s for s, length in enumerate(lengths) for _ in range(length)]
    mask = (torch.rand(n, generator=g) > 0.2).to(F64)
    seq_adv = torch.randn(len(lengths), generator=g, dtype=F64)
    return dict(
        curr=(-torch.rand(n, generator=g, dtype=F64) * 2).tolist(),
        prev=(-torch.rand(n, generator=g, dtype=F64) * 2).tolist(),
        gen=(-torch.rand(n, generator=g, dtype=F64) * 2).tolist(),
        ref=(-torch.rand(n, generator=g, dtype=F64) * 2).tolist(),
        adv=seq_adv[torch.tensor(seq_index)].tolist(),
        mask=mask.tolist(),
        seq_index=seq_index,
    )


def normalizer_of(batch, cfg):
    if cfg.token_level_loss:
        return sum(batch["mask"])
    return len({s for s, m in zip(batch["seq_index"], batch["mask"]) if m > 0})


def loss_and_grad_in_parts(batch, cfg, seq_splits, normalizer):
    """Run grpo_loss per micro-batch (cut at sequence boundaries) on one leaf: summed loss, grad, metrics."""
    curr = torch.tensor(batch["curr"], dtype=F64, requires_grad=True)
    seq_index = torch.tensor(batch["seq_index"])
    total, parts = torch.zeros((), dtype=F64), []
    for first, last in zip(seq_splits[:-1], seq_splits[1:]):
        rows = ((seq_index >= first) & (seq_index < last)).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        pick = lambda key: torch.tensor(batch[key], dtype=F64)[rows]  # noqa: E731
        loss, metrics = grpo_loss(curr[rows], pick("prev"), pick("gen"), pick("ref"), pick("adv"), pick("mask"),
                                  seq_index[rows] - first, last - first, cfg, normalizer)
        total = total + loss
        parts.append(metrics)
    total.backward()
    return total.item(), curr.grad, parts


ALL_ON = dict(reference_policy_kl_penalty=0.3, ratio_clip_c=2.0, use_importance_sampling_correction=True,
              truncated_importance_sampling_ratio=1.5, use_on_policy_kl_approximation=True,
              kl_input_clamp_value=1.0, kl_output_clamp_value=0.8)
CONFIGS = [
    LossFnCfg(**ALL_ON, token_level_loss=True),
    LossFnCfg(**ALL_ON, token_level_loss=False, reference_policy_kl_type="k2"),
    LossFnCfg(**ALL_ON, token_level_loss=False, sequence_level_importance_ratios=True,
              truncated_importance_sampling_type="icepop", reference_policy_kl_type="k1"),
    LossFnCfg(token_level_loss=True),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_loop_reference_and_is_split_invariant(cfg):
    lengths = [3, 1, 5, 2, 4, 2, 6]
    batch = random_batch(0, lengths)
    normalizer = normalizer_of(batch, cfg)
    curr = torch.tensor(batch["curr"], dtype=F64, requires_grad=True)
    expected = loop_grpo_loss(curr, batch["prev"], batch["gen"], batch["ref"], batch["adv"], batch["mask"],
                              batch["seq_index"], cfg, normalizer)
    expected.backward()

    whole_loss, whole_grad, whole_parts = loss_and_grad_in_parts(batch, cfg, [0, 7], normalizer)
    close(whole_loss, expected.item())
    torch.testing.assert_close(whole_grad, curr.grad)

    # Three uneven micro-batches: 1, 4 and 2 sequences.
    split_loss, split_grad, parts = loss_and_grad_in_parts(batch, cfg, [0, 1, 5, 7], normalizer)
    close(split_loss, whole_loss, tol=1e-12)
    torch.testing.assert_close(split_grad, whole_grad)
    whole_metrics = finalize_metrics(whole_parts[0])
    split_metrics = finalize_metrics(reduce_metric_sums(parts))
    assert split_metrics.keys() == whole_metrics.keys()
    for name, value in whole_metrics.items():
        assert split_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert whole_metrics["loss/total"] == pytest.approx(whole_loss, rel=1e-6)


@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_two_ranks_with_the_global_normalizer(cfg):
    """Each "rank" takes half the sequences; DP averages gradients, times dp_size = the full gradient."""
    lengths = [2, 5, 1, 3, 4, 3]
    batch = random_batch(1, lengths)
    normalizer = normalizer_of(batch, cfg)  # over the whole step, both ranks
    full_loss, full_grad, _ = loss_and_grad_in_parts(batch, cfg, [0, 6], normalizer)
    loss_a, grad_a, _ = loss_and_grad_in_parts(batch, cfg, [0, 3], normalizer)
    loss_b, grad_b, _ = loss_and_grad_in_parts(batch, cfg, [3, 6], normalizer)
    # Each rank's own tokens: rank a owns the first 8 tokens, rank b the rest.
    cut = sum(lengths[:3])
    assert torch.all(grad_a[cut:] == 0) and torch.all(grad_b[:cut] == 0)
    averaged = (grad_a + grad_b) / 2
    torch.testing.assert_close(averaged * 2, full_grad)
    close(loss_a + loss_b, full_loss, tol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    cuts=st.sets(st.integers(1, 5), max_size=3),
    seed=st.integers(0, 2**16),
    cfg_index=st.integers(0, len(CONFIGS) - 1),
)
def test_any_micro_batch_split_gives_the_whole_batch_loss_and_gradient(lengths, cuts, seed, cfg_index):
    cfg = CONFIGS[cfg_index]
    batch = random_batch(seed, lengths)
    normalizer = max(normalizer_of(batch, cfg), 1)
    splits = [0, *sorted(c for c in cuts if c < len(lengths)), len(lengths)]
    whole_loss, whole_grad, _ = loss_and_grad_in_parts(batch, cfg, [0, len(lengths)], normalizer)
    split_loss, split_grad, _ = loss_and_grad_in_parts(batch, cfg, splits, normalizer)
    close(split_loss, whole_loss, tol=1e-12)
    torch.testing.assert_close(split_grad, whole_grad)


# ---------------------------------------------------------------- SFT


def test_sft_loss():
    curr = torch.tensor([LN(0.5), LN(0.25), float("-inf"), LN(0.125)], dtype=F64, requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64)
    # Two micro-batches of one step with 3 valid tokens.
    sft = make_loss("sft", LossFnCfg())

    def sft_loss(rows: slice, normalizer: float):
        n = len(mask[rows])
        seq_index = torch.zeros(n, dtype=torch.long)
        return sft(LossInputs(curr[rows], None, None, None, torch.zeros(n, dtype=F64), mask[rows], seq_index, 1),
                   normalizer)

    loss_a, metrics_a = sft_loss(slice(0, 2), 3.0)
    loss_b, metrics_b = sft_loss(slice(2, 4), 3.0)
    (loss_a + loss_b).backward()
    nll = LN(2.0) + LN(4.0) + LN(8.0)
    close((loss_a + loss_b).item(), nll / 3)
    close(curr.grad.tolist(), [-1 / 3, -1 / 3, 0.0, -1 / 3])
    metrics = finalize_metrics(reduce_metric_sums([metrics_a, metrics_b]))
    assert metrics.keys() == {"loss/total", "loss/nll", "batch/valid_tokens"}
    close(metrics["loss/total"], nll / 3, tol=1e-6)
    close(metrics["loss/nll"], nll / 3, tol=1e-6)
    assert metrics["batch/valid_tokens"] == 3


# ---------------------------------------------------------------- metrics


def test_grpo_metric_values():
    cfg = LossFnCfg(use_importance_sampling_correction=True)
    # Two tokens: r = 1.5 (A = 1, clipped) and r = 1; gen: w = 2 and 0.5.
    _, _, m = run([LN(1.5), 0.0], [1.0, 3.0], cfg, gen=[-LN(2.0), LN(2.0)])
    metrics = finalize_metrics(m)
    expected = {
        "policy/clip_fraction": 0.5, "policy/ratio_mean": 1.25, "policy/ratio_max": 1.5, "policy/ratio_min": 1.0,
        "policy/is_weight_mean": 1.25, "policy/is_weight_max": 2.0, "policy/is_weight_min": 0.5,
        "policy/is_truncated_fraction": 0.0, "policy/advantage_mean": 2.0,
        "policy/reference_kl": 0.0, "loss/kl": 0.0, "batch/valid_tokens": 2.0, "batch/valid_sequences": 2.0,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6), name
    # -(1.2 * 2 + 1 * 3 * 0.5) / 2
    assert metrics["loss/total"] == pytest.approx(-(2.4 + 1.5) / 2, rel=1e-6)
    assert metrics["loss/policy_gradient"] == metrics["loss/total"]
