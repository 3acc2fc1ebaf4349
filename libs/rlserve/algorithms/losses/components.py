"""The pieces policy-gradient losses are built from, in the order a loss uses them.

Ratio, clipping, the generator importance weight, the reference KL and the
aggregation over tokens: each a plain function over flat [N] token vectors
(layout in `rlserve.algorithms.losses`), named as in its paper.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sequence_mean(values: Tensor, valid: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """Mean of `values` over each sequence's valid tokens, [num_seqs]; 0 for a sequence without any."""
    weight = valid.to(values.dtype)
    tokens = weight.new_zeros(num_seqs).index_add(0, seq_index, weight)
    sums = values.new_zeros(num_seqs).index_add(0, seq_index, values * weight)
    return sums / tokens.clamp(min=1)


def policy_ratio(curr_logprobs: Tensor, prev_logprobs: Tensor, valid: Tensor, seq_index: Tensor, num_seqs: int,
                 sequence_level: bool) -> Tensor:
    """r = pi_curr / pi_prev per token, PPO's importance ratio (Schulman et al. 2017, arXiv:1707.06347).

    Sequence level: one ratio per sequence, the geometric mean of its valid
    tokens' ratios, broadcast to its tokens: GSPO's length-normalised ratio
    (Zheng et al. 2025, arXiv:2507.18071).
    """
    log_ratio = curr_logprobs - prev_logprobs
    if sequence_level:
        log_ratio = sequence_mean(log_ratio, valid, seq_index, num_seqs)[seq_index]
    return torch.exp(log_ratio)


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic clipped loss per token, with the optional dual clip.

    PPO (Schulman et al. 2017, arXiv:1707.06347): -min(r A, clip(r, 1 - eps_low,
    1 + eps_high) A), with separate low/high ranges as in DAPO's clip-higher (Yu
    et al. 2025, arXiv:2503.14476). Dual clip (Ye et al. 2020, arXiv:1912.09729):
    for A < 0 the loss is also capped at -c A, so a token whose ratio exploded
    cannot dominate the batch. Returns (loss, clipped, dual_clipped); the masks
    mark tokens whose gradient a clip cut off.
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


def cispo_surrogate(ratio: Tensor, advantages: Tensor, curr_logprobs: Tensor, clip_low: float,
                    clip_high: float) -> tuple[Tensor, Tensor]:
    """CISPO's loss per token: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_curr.

    CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585, eq. 4) clips the importance
    weight, detached, instead of the update: every token keeps a gradient through
    log pi_curr, bounded by the clipped weight, where PPO's clip zeroes the
    gradient of a token whose ratio left the range. Returns (loss, clipped), the
    mask marking tokens whose weight the clip changed.
    """
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return -advantages * weight.detach() * curr_logprobs, clipped


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


def on_policy_kl_weight(curr_logprobs: Tensor, gen_logprobs: Tensor) -> Tensor:
    """pi_curr / pi_gen per token, detached: the weight that makes the KL estimate on-policy.

    The tokens come from pi_gen, but KL(pi_curr || pi_ref) is an expectation
    under pi_curr (NeMo-RL's ClippedPGLossFn, docs/guides/grpo.md#on-policy-kl-approximation).
    """
    return torch.exp(curr_logprobs - gen_logprobs).detach().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def aggregate(per_token: Tensor, valid: Tensor, seq_index: Tensor, num_seqs: int, token_level: bool,
              global_normalizer: Tensor | float) -> Tensor:
    """This micro-batch's share of the step loss.

    Token level (DAPO, Yu et al. 2025, arXiv:2503.14476): every valid token of
    the step weighs the same. Sequence level (the GRPO paper's form, Shao et al.
    2024, arXiv:2402.03300): each sequence's token mean weighs the same,
    whatever its length.
    """
    if token_level:
        return (per_token * valid.to(per_token.dtype)).sum() / global_normalizer
    return sequence_mean(per_token, valid, seq_index, num_seqs).sum() / global_normalizer
