"""GRPO's clipped policy-gradient loss with reference KL, in decoupled-PPO form.

GRPO: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300. Per token, with
r = pi_curr / pi_prev (the PPO ratio) and w = pi_prev / pi_gen (the generator
importance weight):

    loss_t = w * max(-r A, -clip(r) A) [dual-clipped]  +  beta * KL_t

aggregated over the step's tokens or sequences (CISPO, `cispo.py`, changes
only the first term: `surrogate`). The decoupled form (the ratio
against the step's starting policy, the weight against the generator) follows
AReaL and NeMo-RL's ClippedPGLossFn; every `loss_fn` key switches one piece of
`components` on or off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlserve.algorithms.interfaces import Loss, LossInputs
from rlserve.algorithms.losses.components import (
    aggregate,
    behaviour_importance_weight,
    clipped_surrogate,
    on_policy_kl_weight,
    policy_ratio,
    reference_kl,
    truncate_importance_weight,
)
from rlserve.algorithms.metrics import masked_extreme
from rlserve.config.algorithms import LossFnCfg


class GrpoLoss(Loss):
    needs_generator_logprobs = True
    needs_prev_logprobs = True
    minibatched = True

    def __init__(self, cfg: LossFnCfg):
        self.cfg = cfg
        # With loss_fn.use_kl_in_reward the KL is the advantage estimator's (REINFORCE++), not the loss's.
        self.beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        self.needs_reference_logprobs = self.beta > 0
        self.token_level = cfg.token_level_loss

    def surrogate(self, ratio: Tensor, adv: Tensor, curr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(policy-gradient loss per token, clipped, dual-clipped): PPO's clipped surrogate."""
        cfg = self.cfg
        return clipped_surrogate(ratio, adv, cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c)

    def __call__(self, inputs: LossInputs, global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, seq_index, num_seqs = self.cfg, inputs.seq_index, inputs.num_seqs
        beta = self.beta
        if beta > 0 and inputs.ref_logprobs is None:
            raise ValueError("loss_fn.reference_policy_kl_penalty > 0 needs reference logprobs")
        valid = inputs.mask > 0
        # Masked tokens may hold anything (padding, a -inf from a top-k mismatch); zeroing
        # them keeps NaN out of the sums and out of the gradient.
        curr, prev, gen, adv = (torch.where(valid, x, 0.0) for x in (
            inputs.curr_logprobs, inputs.prev_logprobs, inputs.gen_logprobs, inputs.advantages))

        # 1. The policy-gradient term on the PPO ratio (per token, or per sequence for GSPO).
        ratio = policy_ratio(curr, prev, valid, seq_index, num_seqs, cfg.sequence_level_importance_ratios)
        pg, clipped, dual_clipped = self.surrogate(ratio, adv, curr)

        # 2. Generator -> learner importance weight, truncated (measured even when not applied).
        is_weight = behaviour_importance_weight(prev, gen, valid, seq_index, num_seqs,
                                                cfg.sequence_level_importance_ratios)
        if cfg.use_importance_sampling_correction:
            w, truncated = truncate_importance_weight(is_weight, cfg.truncated_importance_sampling_type,
                                                      cfg.truncated_importance_sampling_ratio,
                                                      cfg.truncated_importance_sampling_ratio_min)
        else:
            w, truncated = torch.ones_like(is_weight), torch.zeros_like(valid)

        # 3. KL to the reference, optionally reweighted to be on-policy.
        if beta > 0:
            kl = reference_kl(curr, torch.where(valid, inputs.ref_logprobs, 0.0), cfg.reference_policy_kl_type,
                              cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
        else:
            kl = torch.zeros_like(curr)
        kl_weight = on_policy_kl_weight(curr, gen) if cfg.use_on_policy_kl_approximation else torch.ones_like(kl)

        # 4. This micro-batch's share of the step loss.
        pg_loss = aggregate(w * pg, valid, seq_index, num_seqs, cfg.token_level_loss, global_normalizer)
        kl_loss = aggregate(beta * kl_weight * kl, valid, seq_index, num_seqs, cfg.token_level_loss,
                            global_normalizer)
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
                "ratio_max": masked_extreme(ratio, valid, largest=True),
                "ratio_min": masked_extreme(ratio, valid, largest=False),
                "clip_count": total(clipped),
                "dual_clip_count": total(dual_clipped),
                "is_weight_sum": total(is_weight),
                "is_weight_max": masked_extreme(is_weight, valid, largest=True),
                "is_weight_min": masked_extreme(is_weight, valid, largest=False),
                "is_truncated_count": total(truncated),
                "advantage_sum": total(adv),
                "token_count": weight.sum(),
                "seq_count": (tokens_per_seq > 0).float().sum(),
            }
        return loss, metrics
