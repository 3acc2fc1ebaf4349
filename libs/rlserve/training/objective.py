"""One learner step's plan and loss bookkeeping, shared by every backend.

A GRPO step of S sequences is cut into optimizer minibatches of
`policy.train_global_batch_size` sequences; each data-parallel rank takes its
share of a minibatch as micro-batches. Losses are divided by global counts
(all micro-batches, all ranks) so that accumulating gradients over
micro-batches and averaging over ranks gives the full-minibatch gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlserve.algorithms.losses import all_reduce_metric_sums, finalize_metrics, grpo_loss, reduce_metric_sums, sft_loss
from rlserve.config.spec import RunSpec
from rlserve.training.batch import MicroBatch, TrainBatch, rank_micro_batches


class StepObjective:
    def __init__(self, spec: RunSpec, batch: TrainBatch, loss: str, dp_size: int, dp_rank: int, pad_id: int):
        if loss not in ("grpo", "sft"):
            raise ValueError(f"unknown loss {loss!r}; valid: grpo, sft")
        if loss == "grpo" and batch.gen_logprobs is None:
            raise ValueError("a GRPO step needs the generator's logprobs")
        self.spec, self.loss = spec, loss
        n = batch.num_seqs
        gbs = spec.policy.train_global_batch_size if loss == "grpo" else None
        gbs = gbs or n
        # Dropped groups make batches smaller than nominal: the last update may take fewer sequences.
        minibatches = [list(range(k, min(k + gbs, n))) for k in range(0, n, gbs)]
        packing = spec.policy.sequence_packing
        self.plans: list[list[MicroBatch]] = [
            rank_micro_batches(batch, idx, dp_rank, dp_size, packed=packing.enabled,
                               micro_batch_size=spec.policy.train_micro_batch_size,
                               mb_tokens=packing.train_mb_tokens, pad_id=pad_id, algorithm=packing.algorithm)
            for idx in minibatches]
        token_level = loss == "sft" or spec.loss_fn.token_level_loss
        self.normalizers = [float(max(1, batch.num_completion_tokens(idx))) if token_level else float(len(idx))
                            for idx in minibatches]
        self.total_tokens = int(batch.seq_lens.sum())
        self.needs_prev_logprobs = loss == "grpo" and len(minibatches) > 1
        self._sums: list[dict[str, torch.Tensor]] = []

    def micro_batch_loss(self, k: int, mb: MicroBatch, curr: torch.Tensor, prev: torch.Tensor | None,
                         entropy: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of micro-batch `mb` of minibatch `k`, divided by the minibatch's global count."""
        mask = torch.ones_like(curr)
        if self.loss == "sft":
            loss, sums = sft_loss(curr, mask, self.normalizers[k])
        else:
            loss, sums = grpo_loss(curr, curr.detach() if prev is None else prev, mb.gen_logprobs,
                                   mb.ref_logprobs if self.spec.loss_fn.reference_policy_kl_penalty > 0 else None,
                                   mb.advantages, mask, mb.seq_index, mb.num_seqs, self.spec.loss_fn,
                                   self.normalizers[k])
        if entropy is not None:
            sums["entropy_sum"] = entropy.detach().float().sum()
        self._sums.append(sums)
        return loss

    def finalize(self, dp_group: dist.ProcessGroup | None) -> dict[str, float]:
        """Step metrics over all micro-batches and data-parallel ranks (one host sync)."""
        sums = all_reduce_metric_sums(reduce_metric_sums(self._sums), dp_group)
        metrics = finalize_metrics(sums)
        # Losses were summed over minibatches; report the mean per optimizer update.
        for key in ("loss/total", "loss/policy_gradient", "loss/kl"):
            if key in metrics:
                metrics[key] /= len(self.plans)
        return metrics
