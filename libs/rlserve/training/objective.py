"""One learner step's plan and loss bookkeeping, shared by every backend.

A step of S sequences is cut into optimizer minibatches of
`policy.train_global_batch_size` sequences (for a loss that is `minibatched`,
like GRPO's); each data-parallel rank takes its share of a minibatch as
micro-batches. Losses are divided by global counts (all micro-batches, all
ranks) so that accumulating gradients over micro-batches and averaging over
ranks gives the full-minibatch gradient. The loss is chosen by name
(`rlserve.algorithms.registry`) and says what it needs; nothing here knows a
loss by name. Whatever the loss, a batch with the generator's logprobs is
measured against the learner's at the start of the step
(`rlserve.algorithms.mismatch`: the step's `mismatch/*` metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.metrics import all_reduce_metric_sums, finalize_metrics, reduce_metric_sums
from rlserve.algorithms.mismatch import mismatch_sums
from rlserve.algorithms.registry import loss_for_run
from rlserve.config.spec import RunSpec
from rlserve.training.batch import MicroBatch, TrainBatch, rank_micro_batches


class StepObjective:
    def __init__(self, spec: RunSpec, batch: TrainBatch, loss_name: str, dp_size: int, dp_rank: int, pad_id: int):
        self.loss = loss_for_run(loss_name, spec)
        if self.loss.needs_generator_logprobs and batch.gen_logprobs is None:
            raise ValueError(f"the {loss_name} loss needs the generator's logprobs")
        n = batch.num_seqs
        gbs = (spec.policy.train_global_batch_size if self.loss.minibatched else None) or n
        # Dropped groups make batches smaller than nominal: the last update may take fewer sequences.
        minibatches = [list(range(k, min(k + gbs, n))) for k in range(0, n, gbs)]
        packing = spec.policy.sequence_packing
        # A paired loss (DPO) sees each pair, sequences 2k and 2k + 1, whole in one micro-batch.
        unit = 2 if self.loss.paired else 1
        if n % unit:
            raise ValueError(f"the {loss_name} loss trains on pairs of sequences, got {n}")
        self.plans: list[list[MicroBatch]] = [
            rank_micro_batches(batch, idx, dp_rank, dp_size, packed=packing.enabled,
                               micro_batch_size=spec.policy.train_micro_batch_size,
                               mb_tokens=packing.train_mb_tokens, pad_id=pad_id, algorithm=packing.algorithm,
                               unit=unit)
            for idx in minibatches]
        self.normalizers = [float(max(1, batch.num_loss_tokens(idx))) if self.loss.token_level
                            else float(len(idx)) for idx in minibatches]
        self.total_tokens = int(batch.seq_lens.sum())
        # With one update per step the starting policy is the one being trained (prev = curr, detached).
        self.needs_prev_logprobs = self.loss.needs_prev_logprobs and len(minibatches) > 1
        # The loss needs the reference policy's logprobs and the batch brings none: a LoRA learner
        # computes them itself, with its adapters off (`set_reference`).
        self.reference_missing = self.loss.needs_reference_logprobs and batch.ref_logprobs is None
        self.loss_cfg = spec.loss_fn
        self._sums: list[dict[str, torch.Tensor]] = []

    def prev_logprobs(self, forward: Callable[[list[MicroBatch]], list[torch.Tensor | None]]
                      ) -> list[list[torch.Tensor | None]]:
        """Logprobs under the step's starting weights per planned micro-batch, from `forward` (one
        minibatch's micro-batches -> their logprobs), for the updates after the first only: the first
        trains at the starting weights, so its own logprobs, detached, are these (None here: one
        forward pass over a minibatch fewer, and a ratio of exactly 1)."""
        return [[None] * len(self.plans[0])] + [forward(plan) for plan in self.plans[1:]]

    def set_reference(self, logprobs: list[list[torch.Tensor]]) -> None:
        """Reference logprobs per planned micro-batch ([minibatch][micro-batch], as `plans`)."""
        self.plans = [[replace(mb, ref_logprobs=lp) for mb, lp in zip(plan, lps)]
                      for plan, lps in zip(self.plans, logprobs)]
        self.reference_missing = False

    def micro_batch_loss(self, k: int, mb: MicroBatch, curr: torch.Tensor, prev: torch.Tensor | None,
                         entropy: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of micro-batch `mb` of minibatch `k`, divided by the minibatch's global count."""
        mask = torch.ones_like(curr) if mb.loss_mask is None else mb.loss_mask.to(curr.dtype)
        inputs = LossInputs(curr_logprobs=curr, prev_logprobs=curr.detach() if prev is None else prev,
                            gen_logprobs=mb.gen_logprobs,
                            ref_logprobs=mb.ref_logprobs if self.loss.needs_reference_logprobs else None,
                            advantages=mb.advantages, mask=mask,
                            seq_index=mb.seq_index,
                            num_seqs=mb.num_seqs)
        loss, sums = self.loss(inputs, self.normalizers[k])
        if entropy is not None:
            sums["entropy_sum"] = (entropy.detach().float() * mask).sum()
        if mb.gen_logprobs is not None:
            # The generator against the learner at the start of the step (`prev`; this update's own
            # logprobs for the first one, which trains at those weights).
            sums.update(mismatch_sums(inputs.prev_logprobs, mb.gen_logprobs, mask > 0, self.loss_cfg,
                                      mb.token_ages, mb.token_turns))
        self._sums.append(sums)
        return loss

    def finalize(self, dp_group: dist.ProcessGroup | None) -> dict[str, float]:
        """Step metrics over all micro-batches and data-parallel ranks (one host sync)."""
        sums = all_reduce_metric_sums(reduce_metric_sums(self._sums), dp_group)
        metrics = finalize_metrics(sums, self.loss.reported_sums)
        # Losses were summed over minibatches; report the mean per optimizer update.
        for key in ("loss/total", "loss/policy_gradient", "loss/kl", "loss/preference", "loss/sft"):
            if key in metrics:
                metrics[key] /= len(self.plans)
        return metrics
