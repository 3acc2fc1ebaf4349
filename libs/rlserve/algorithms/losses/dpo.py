"""DPO: the preference loss on (chosen, rejected) pairs against the frozen reference policy.

DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7), per pair with
h(y) = log pi(y|x) - log pi_ref(y|x) summed over the response's tokens:

    loss = -log sigmoid(beta * (h(y_w) - h(y_l)))

averaged over the step's pairs. NeMo-RL's `dpo` keys add an SFT term on the
chosen response (`sft_loss_weight`, its NLL) and per-token means instead of
sums (`preference_average_log_probs`, `sft_average_log_probs`). The batch
holds each pair as two adjacent sequences, chosen first, which the step's
plan keeps in one micro-batch (`paired`); the step's normaliser counts
sequences, two per pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlserve.algorithms.interfaces import Loss, LossInputs
from rlserve.config.algorithms import DpoCfg


class DpoLoss(Loss):
    needs_generator_logprobs = False
    needs_prev_logprobs = False
    # One optimizer update per step (dpo.batch_size pairs).
    minibatched = False
    paired = True

    def __init__(self, cfg: DpoCfg):
        self.cfg = cfg
        self.needs_reference_logprobs = True
        self.token_level = False

    def __call__(self, inputs: LossInputs, global_normalizer: Tensor | float) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, num_seqs = self.cfg, inputs.num_seqs
        if num_seqs % 2:
            raise ValueError(f"a DPO micro-batch holds whole (chosen, rejected) pairs, got {num_seqs} sequences")
        if inputs.ref_logprobs is None:
            raise ValueError("the dpo loss needs the reference policy's logprobs")
        valid = inputs.mask > 0
        weight = valid.to(inputs.curr_logprobs.dtype)
        curr = torch.where(valid, inputs.curr_logprobs, 0.0)
        ref = torch.where(valid, inputs.ref_logprobs, 0.0)

        def per_sequence(x: Tensor) -> Tensor:  # [pairs, 2]: (chosen, rejected)
            return x.new_zeros(num_seqs).index_add(0, inputs.seq_index, x).view(-1, 2)

        tokens = per_sequence(weight).clamp(min=1)
        logp, ref_logp = per_sequence(curr), per_sequence(ref)
        # h(y) = log pi(y) - log pi_ref(y), summed (or averaged) over the response.
        h = (logp - ref_logp) / (tokens if cfg.preference_average_log_probs else 1.0)
        margin = cfg.reference_policy_kl_penalty * (h[:, 0] - h[:, 1])
        preference = -F.logsigmoid(margin)
        sft = -logp[:, 0] / (tokens[:, 0] if cfg.sft_average_log_probs else 1.0)
        per_pair = cfg.preference_loss_weight * preference + cfg.sft_loss_weight * sft
        # The normaliser counts the step's sequences, two per pair.
        loss = 2.0 * per_pair.sum() / global_normalizer

        with torch.no_grad():
            rewards = cfg.reference_policy_kl_penalty * (logp - ref_logp)  # DPO's implicit rewards
            metrics = {
                "loss_sum": loss.detach().float(),
                "preference_loss_sum": (2.0 * preference.sum() / global_normalizer).detach().float(),
                "sft_loss_sum": (2.0 * sft.sum() / global_normalizer).detach().float(),
                "accuracy_count": (margin > 0).float().sum(),
                "margin_sum": margin.detach().float().sum(),
                "chosen_reward_sum": rewards[:, 0].float().sum(),
                "rejected_reward_sum": rewards[:, 1].float().sum(),
                "pair_count": torch.tensor(float(margin.numel()), device=margin.device),
                "token_count": weight.float().sum(),
                "seq_count": torch.tensor(float(num_seqs), device=margin.device),
            }
        return loss, metrics
