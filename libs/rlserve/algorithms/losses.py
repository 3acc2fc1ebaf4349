"""GRPO and SFT losses over flat token vectors, and the metric sums they report.

Layout. The learner gathers a micro-batch's completion tokens into 1-D vectors
of N tokens, whatever its padded or packed layout: `mask` marks the tokens that
count and `seq_index` (0..num_seqs-1) names each token's sequence, so
per-sequence sums are one `index_add`, never a Python loop.

Normalisation. Each micro-batch divides by a *global* normaliser: the valid
tokens (token-level loss) or the sequences (sequence-level loss) of the whole
optimizer step, over all micro-batches and data-parallel ranks. Summing the
micro-batch losses, and summing gradients over ranks (the backend's average
times dp_size), then gives exactly the full-batch loss and gradient, however
the batch was split (NeMo-RL's global_valid_toks / global_valid_seqs). A
sequence must lie whole in one micro-batch.

Metrics. Each loss returns a dict of 0-d tensors that combine across
micro-batches and ranks without any host sync: keys ending in `_sum` or
`_count` add, `_max` / `_min` take the max / min (`reduce_metric_sums`, then
`all_reduce_metric_sums`). The loss terms `loss_sum`, `pg_loss_sum` and
`kl_loss_sum` are each micro-batch's share of the step objective (already
divided by the global normaliser), so their sum is the step's value; every
other `_sum` / `_count` is a raw sum over valid tokens, turned into a mean by
`finalize_metrics`, which runs once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlserve.config.spec import LossFnCfg


def sequence_mean(values: Tensor, valid: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """Mean of `values` over each sequence's valid tokens, [num_seqs]; 0 for a sequence without any."""
    weight = valid.to(values.dtype)
    tokens = weight.new_zeros(num_seqs).index_add(0, seq_index, weight)
    sums = values.new_zeros(num_seqs).index_add(0, seq_index, values * weight)
    return sums / tokens.clamp(min=1)


def aggregate(per_token: Tensor, valid: Tensor, seq_index: Tensor, num_seqs: int, token_level: bool,
              global_normalizer: Tensor | float) -> Tensor:
    """This micro-batch's share of the step loss.

    Token level (DAPO, Yu et al. 2025, arXiv:2503.14476): every valid token of
    the step weighs the same. Sequence level (the GRPO paper's form): each
    sequence's token mean weighs the same, whatever its length.
    """
    if token_level:
        return (per_token * valid.to(per_token.dtype)).sum() / global_normalizer
    return sequence_mean(per_token, valid, seq_index, num_seqs).sum() / global_normalizer


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic clipped loss per token, with the optional dual clip.

    PPO (Schulman et al. 2017, arXiv:1707.06347): -min(r A, clip(r, 1 - eps_low,
    1 + eps_high) A), with separate low/high ranges as in DAPO. Dual clip (Ye et
    al. 2020, arXiv:1912.09729): for A < 0 the loss is also capped at -c A, so a
    token whose ratio exploded cannot dominate the batch. Returns (loss, clipped,
    dual_clipped); the masks mark tokens whose gradient a clip cut off.
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if clip_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    dual_loss = -advantages * clip_c
    dual_clipped = (advantages < 0) & (dual_loss < loss)
    return torch.where(dual_clipped, dual_loss, loss), clipped, dual_clipped


def behaviour_importance_weight(prev_logprobs: Tensor, gen_logprobs: Tensor, valid: Tensor, seq_index: Tensor,
                                num_seqs: int, sequence_level: bool) -> Tensor:
    """w = pi_prev / pi_gen per token, detached.

    The tokens were sampled by the generator, whose weights may be versions
    older (async GRPO) and whose numerics differ (vLLM kernels), not by the
    policy the PPO ratio is taken against. Decoupled PPO (Hilton et al. 2022,
    arXiv:2110.00641; AReaL, Fu et al. 2025, arXiv:2505.24298) corrects the
    gradient by this weight. Sequence level: exp of the mean log weight over the
    sequence's valid tokens, GSPO's length-normalised ratio (Zheng et al. 2025,
    arXiv:2507.18071), broadcast to its tokens.
    """
    log_w = (prev_logprobs - gen_logprobs).detach()
    if sequence_level:
        log_w = sequence_mean(log_w, valid, seq_index, num_seqs)[seq_index]
    # A token one side gave a -inf logprob gets weight 0, as in NeMo-RL's ClippedPGLossFn.
    return torch.exp(log_w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def truncate_importance_weight(w: Tensor, kind: str, ratio_max: float | None,
                               ratio_min: float | None) -> tuple[Tensor, Tensor]:
    """(truncated w, mask of the tokens the truncation changed); ratio_max None: no truncation.

    "tis": min(w, ratio_max), truncated importance sampling (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"):
    bounds the variance a rare large weight brings. "icepop": w * 1[ratio_min <=
    w <= ratio_max], ratio_min defaulting to 1 / ratio_max (IcePop, Ling team
    2025, Ring-1T report): drops tokens whose generator/learner mismatch is too
    large in either direction instead of trusting a capped weight.
    """
    if ratio_max is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    if kind == "tis":
        return w.clamp(max=ratio_max), w > ratio_max
    if kind == "icepop":
        low = 1.0 / ratio_max if ratio_min is None else ratio_min
        outside = (w < low) | (w > ratio_max)
        return torch.where(outside, 0.0, w), outside
    raise ValueError(f"unknown truncated importance sampling type {kind!r}; valid: tis, icepop")


def reference_kl(curr_logprobs: Tensor, ref_logprobs: Tensor, kl_type: str, input_clamp: float | None,
                 output_clamp: float | None) -> Tensor:
    """Per-token estimate of KL(pi_curr || pi_ref) from the sampled token alone.

    Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html),
    with log x = log pi_ref - log pi_curr: k1 = -log x, k2 = (log x)^2 / 2,
    k3 = x - 1 - log x (unbiased and never negative). log x is clamped to
    +-input_clamp before and the estimate to +-output_clamp after, as in NeMo-RL's
    `calculate_kl`, so one wild token cannot blow up the loss.
    """
    log_x = ref_logprobs - curr_logprobs
    if input_clamp is not None:
        log_x = log_x.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -log_x
    elif kl_type == "k2":
        kl = 0.5 * log_x.square()
    elif kl_type == "k3":
        kl = torch.expm1(log_x) - log_x
    else:
        raise ValueError(f"unknown KL type {kl_type!r}; valid: k1, k2, k3")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def grpo_loss(curr_logprobs: Tensor, prev_logprobs: Tensor, gen_logprobs: Tensor, ref_logprobs: Tensor | None,
              advantages: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int, cfg: LossFnCfg,
              global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped policy-gradient loss with reference KL, in decoupled-PPO form.

    All tensors are [N] over the micro-batch's tokens. curr: the policy being
    trained (with grad); prev: the same policy at the start of this GRPO step,
    the PPO "old" policy of the ratio; gen: the generator that sampled the
    tokens, the behaviour policy of the importance weight; ref: the frozen
    reference (None when the KL penalty is 0). Per token, with r = pi_curr /
    pi_prev and w = pi_prev / pi_gen (see `behaviour_importance_weight`):

        loss_t = w * max(-r A, -clip(r) A) [dual-clipped]  +  beta * KL_t

    aggregated by `aggregate`. GRPO: Shao et al. 2024, arXiv:2402.03300; the
    decoupled form follows AReaL and NeMo-RL's ClippedPGLossFn.
    """
    beta = cfg.reference_policy_kl_penalty
    if beta > 0 and ref_logprobs is None:
        raise ValueError("loss_fn.reference_policy_kl_penalty > 0 needs reference logprobs")
    valid = mask > 0
    # Masked tokens may hold anything (padding, a -inf from a top-k mismatch); zeroing
    # them keeps NaN out of the sums and out of the gradient.
    curr, prev, gen, adv = (torch.where(valid, x, 0.0) for x in (curr_logprobs, prev_logprobs, gen_logprobs,
                                                                  advantages))

    log_ratio = curr - prev
    if cfg.sequence_level_importance_ratios:
        # GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios.
        log_ratio = sequence_mean(log_ratio, valid, seq_index, num_seqs)[seq_index]
    ratio = torch.exp(log_ratio)
    pg, clipped, dual_clipped = clipped_surrogate(ratio, adv, cfg.ratio_clip_min, cfg.ratio_clip_max,
                                                  cfg.ratio_clip_c)

    is_weight = behaviour_importance_weight(prev, gen, valid, seq_index, num_seqs,
                                            cfg.sequence_level_importance_ratios)
    if cfg.use_importance_sampling_correction:
        w, truncated = truncate_importance_weight(is_weight, cfg.truncated_importance_sampling_type,
                                                  cfg.truncated_importance_sampling_ratio,
                                                  cfg.truncated_importance_sampling_ratio_min)
    else:
        w, truncated = torch.ones_like(is_weight), torch.zeros_like(valid)

    if beta > 0:
        kl = reference_kl(curr, torch.where(valid, ref_logprobs, 0.0), cfg.reference_policy_kl_type,
                          cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
    else:
        kl = torch.zeros_like(curr)
    if cfg.use_on_policy_kl_approximation:
        # The tokens come from pi_gen, KL(pi_curr || pi_ref) is an expectation under
        # pi_curr: reweight by pi_curr / pi_gen, detached (NeMo-RL's ClippedPGLossFn,
        # docs/guides/grpo.md#on-policy-kl-approximation).
        kl_weight = torch.exp(curr - gen).detach().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    else:
        kl_weight = torch.ones_like(kl)

    pg_loss = aggregate(w * pg, valid, seq_index, num_seqs, cfg.token_level_loss, global_normalizer)
    kl_loss = aggregate(beta * kl_weight * kl, valid, seq_index, num_seqs, cfg.token_level_loss, global_normalizer)
    loss = pg_loss + kl_loss

    with torch.no_grad():
        weight = valid.float()
        tokens_per_seq = weight.new_zeros(num_seqs).index_add(0, seq_index, weight)

        def total(x: Tensor) -> Tensor:
            return (x.float() * weight).sum()

        metrics = {
            "loss_sum": loss.detach().float(),
            "pg_loss_sum": pg_loss.detach().float(),
            "kl_loss_sum": kl_loss.detach().float(),
            "kl_sum": total(kl),
            "ratio_sum": total(ratio),
            "ratio_max": _masked_extreme(ratio, valid, largest=True),
            "ratio_min": _masked_extreme(ratio, valid, largest=False),
            "clip_count": total(clipped),
            "dual_clip_count": total(dual_clipped),
            "is_weight_sum": total(is_weight),
            "is_weight_max": _masked_extreme(is_weight, valid, largest=True),
            "is_weight_min": _masked_extreme(is_weight, valid, largest=False),
            "is_truncated_count": total(truncated),
            # NeMo-RL's token_mult_prob_error: how far the generator's probabilities are from the learner's.
            "prob_error_sum": total(torch.exp((prev - gen).abs())),
            "advantage_sum": total(adv),
            "token_count": weight.sum(),
            "seq_count": (tokens_per_seq > 0).float().sum(),
        }
    return loss, metrics


def sft_loss(curr_logprobs: Tensor, mask: Tensor,
             global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the valid tokens, divided by the step's valid token count."""
    valid = mask > 0
    nll = -torch.where(valid, curr_logprobs, 0.0)
    loss = nll.sum() / global_normalizer
    metrics = {
        "loss_sum": loss.detach().float(),
        "nll_sum": nll.detach().float().sum(),
        "token_count": valid.float().sum(),
    }
    return loss, metrics


def _masked_extreme(x: Tensor, valid: Tensor, largest: bool) -> Tensor:
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
    "policy/token_mult_prob_error": "prob_error_sum",
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


def finalize_metrics(sums: dict[str, Tensor]) -> dict[str, float]:
    """Namespaced step metrics from the step's reduced sums (one host sync).

    Keys not in `sums` are left out, so this serves GRPO and SFT alike (a backend
    adds "entropy_sum" when it computes per-token entropies). Token means and extremes
    are left out of a step without valid tokens rather than reported as 0 or inf.
    """
    keys = sorted(sums)
    values = dict(zip(keys, torch.stack([sums[k].float().reshape(()) for k in keys]).tolist()))
    out = {name: values[key] for name, key in _STEP_VALUES.items() if key in values}
    tokens = values.get("token_count", 0.0)
    if tokens > 0:
        out |= {name: values[key] / tokens for name, key in _TOKEN_MEANS.items() if key in values}
        out |= {name: values[key] for name, key in _TOKEN_EXTREMES.items() if key in values}
    return out
