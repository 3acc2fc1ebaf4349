"""The learner backend contract, shared by the DTensor/FSDP2 and Megatron-Core backends.

A backend is plain torch.distributed code: every rank of a process group
constructs it and calls the same methods in the same order. It never
imports Ray, so it runs the same under the learner's Ray workers and under
a plain process (tests and the GPU benchmarks, which start their own process groups).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlserve.config.spec import RunSpec
from rlserve.learner import checkpoint
from rlserve.models.hf_io import write_hf_folder
from rlserve.training.batch import MicroBatch, TrainBatch
from rlserve.training.objective import StepObjective
from rlserve.training.primitives import AdamStep, DatumBatch, PrimitiveResult, datum_loss
from rlserve.weights import adapter


@dataclass(frozen=True)
class BackendInfo:
    backend: str
    world_size: int
    parallel_layout: str
    num_parameters: int
    device: str


@dataclass(frozen=True)
class StepResult:
    version: int
    metrics: dict[str, float]


class _Span:
    """Seconds between its start and `end`: on the GPU by CUDA events (read once the step's results are, no host
    sync of its own), else by the host clock."""

    def __init__(self, on_gpu: bool):
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if on_gpu else None
        if self.events:
            self.events[0].record()
        self.t0, self.t1 = time.perf_counter(), 0.0

    def end(self) -> None:
        if self.events:
            self.events[1].record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.events:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1000
        return self.t1 - self.t0


class LearnerBackend(ABC):
    """What a step and a checkpoint mean is fixed here (`train_step`, `save_checkpoint`); a backend
    supplies the machinery that runs the objective's optimizer updates, reduces its metrics over
    its ranks, and saves and restores its model and optimizer."""

    name: str
    # Set by every backend's constructor:
    spec: RunSpec
    model_path: Path
    optimizer: Any  # a torch or Megatron optimizer: param_groups, step
    scheduler: Any  # LambdaLR semantics: step, state_dict
    pad_id: int
    dp_size: int
    dp_rank: int
    _version: int
    # LoRA: the adapter's PEFT config (`rlserve.learner.lora.adapter_config`); None: every weight trains.
    adapter_config: dict | None = None

    @abstractmethod
    def info(self) -> BackendInfo: ...

    @property
    def version(self) -> int:
        """Number of GRPO/SFT steps applied since the initial weights (version 0)."""
        return self._version

    def train_step(self, batch: TrainBatch, loss_name: str, lr: float | None = None) -> StepResult:
        """One step of the registered loss `loss_name` on the whole batch (every rank passes the
        same batch; each takes its share).

        `lr` overrides the schedule for this step (the SFT warm start); otherwise the schedule
        advances once per step.
        """
        t0 = time.perf_counter()
        on_gpu = torch.cuda.is_initialized()  # a learner on a GPU: its step's peak memory is reported
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        objective = StepObjective(self.spec, batch, loss_name, self.dp_size, self.dp_rank, self.pad_id)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        reference_pass = None
        if objective.reference_missing:
            if self.adapter_config is None:
                raise ValueError("the loss needs reference logprobs (loss_fn.reference_policy_kl_penalty > 0) "
                                 "and the batch carries none")
            reference_pass = _Span(on_gpu)
            with torch.no_grad():
                objective.set_reference(self._reference_logprobs(objective))
            reference_pass.end()
        grad_norms = self._run_updates(objective)
        if lr is None:
            self.scheduler.step()
        self._version += 1
        metrics = self._finalize(objective)
        metrics["policy/grad_norm"] = sum(float(n) for n in grad_norms) / len(grad_norms)
        metrics["policy/lr"] = self.optimizer.param_groups[0]["lr"]
        elapsed = time.perf_counter() - t0
        metrics["perf/learner_step_seconds"] = elapsed
        metrics["perf/learner_tokens_per_s"] = objective.total_tokens / elapsed
        if reference_pass is not None:  # a LoRA learner's reference pass (its base, adapters off): the reference
            metrics["perf/learner_reference_seconds"] = reference_pass.seconds()  # service's work in other runs
        if on_gpu:  # what this step held on the GPU at its peak: its tensors, and its caching allocator's reserve
            metrics["perf/learner_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            metrics["perf/learner_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        metrics["usage/trained_tokens"] = float(objective.total_tokens)
        metrics["usage/training_device_s"] = elapsed * (dist.get_world_size() if dist.is_initialized() else 1)
        return StepResult(self._version, metrics)

    @abstractmethod
    def _run_updates(self, objective: StepObjective) -> list[float | torch.Tensor]:
        """Forward/backward and one optimizer update per planned minibatch; their grad norms
        (device tensors are fine: they are read after `_finalize`)."""

    def _reference_logprobs(self, objective: StepObjective) -> list[list[torch.Tensor]]:
        """The reference policy's logprobs of every planned micro-batch: a LoRA learner's base model,
        its adapters off (NeMo-RL and verl do the same; no second model is loaded)."""
        raise NotImplementedError(f"the {self.name} backend has no LoRA reference pass")

    # --- primitives (rlserve.training.primitives): a loss on datums, gradients kept until optim_step ----

    def forward_primitive(self, batch: DatumBatch, backward: bool) -> PrimitiveResult:
        """The batch's loss and the learner's logprobs of every datum's targets; with `backward` its gradients
        are added to those of earlier calls (none are cleared until `optim_step`). Each data-parallel rank
        takes every dp-th datum, one padded micro-batch of `policy.train_micro_batch_size` rows at a time
        (short ranks run empty ones: FSDP's collectives need the same count), and every rank returns all
        datums' logprobs."""
        t0 = time.perf_counter()
        n, per = len(batch.datums), max(1, self.spec.policy.train_micro_batch_size)
        mine = list(range(self.dp_rank, n, self.dp_size))
        rounds = -(-len(range(0, n, self.dp_size)) // per)
        logprobs: dict[int, torch.Tensor] = {}
        loss_sum = torch.zeros(())
        for k in range(rounds):
            idx = mine[k * per:(k + 1) * per]
            mb = datum_micro_batch(batch, idx or [0], self.pad_id, dummy=not idx)
            with torch.set_grad_enabled(backward):
                flat = self._datum_logprobs(mb)
                lps = list(flat.split([int(batch.datums[i].tokens.numel()) for i in idx])) if idx else []
                loss = (datum_loss(DatumBatch([batch.datums[i] for i in idx], batch.loss, batch.config), lps)
                        if idx else flat.sum() * 0.0)
                if backward:
                    # FSDP averages gradients over data-parallel ranks; the loss is a sum: undo the average.
                    (loss * self.dp_size).backward()
            loss_sum += loss.detach().float().cpu()
            logprobs.update({i: lp.detach().float().cpu() for i, lp in zip(idx, lps)})
        if self.dp_size > 1:
            shares: list = [None] * dist.get_world_size()
            dist.all_gather_object(shares, (logprobs, float(loss_sum)))
            logprobs = {i: lp for share, _ in shares for i, lp in share.items()}
            loss_sum = torch.tensor(sum(v for _, v in shares) * self.dp_size / dist.get_world_size())
        elapsed = time.perf_counter() - t0
        metrics = {"loss:sum": float(loss_sum), "usage/trained_tokens:sum": float(batch.num_tokens) if backward
                   else 0.0, "usage/training_device_s:sum": elapsed * (dist.get_world_size()
                                                                       if dist.is_initialized() else 1)}
        return PrimitiveResult([logprobs[i] for i in range(n)], metrics)

    def optim_step(self, step: AdamStep) -> StepResult:
        """One AdamW update on the gradients accumulated since the last one (the SDK's AdamParams: its
        learning rate, betas, eps and decoupled weight decay for this step; `grad_clip_norm` > 0 clips the
        global norm); they are cleared after it. The version advances by one."""
        for group in self.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)
        grad_norm = self._primitive_step(step.grad_clip_norm or None)
        self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        return StepResult(self._version, {"optim/grad_norm:mean": float(grad_norm),
                                          "optim/lr:mean": step.learning_rate})

    def _datum_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """The logprobs of `mb.targets` at its `hidden_index` positions, differentiable (a backend that has
        no such pass refuses the primitives)."""
        raise NotImplementedError(f"the {self.name} learner backend does not run forward/forward_backward/"
                                  f"optim_step; use policy.dtensor_cfg")

    def _primitive_step(self, max_norm: float | None) -> torch.Tensor:
        """Clip (when `max_norm`) and apply the accumulated gradients; the global norm before clipping."""
        raise NotImplementedError(f"the {self.name} learner backend does not run optim_step; use "
                                  f"policy.dtensor_cfg")

    @abstractmethod
    def _finalize(self, objective: StepObjective) -> dict[str, float]:
        """The step's metrics reduced over all ranks; every rank returns the same dict."""

    @abstractmethod
    def export_weights(self, dtype: torch.dtype | None = None, on_device: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF checkpoint-named full tensors (with LoRA: the adapter's, PEFT-named), one at a time. Every
        rank must exhaust the iterator (gathers are collective); only rank 0 gets the tensors, other
        ranks get empty placeholders. In host memory, or with `on_device` left on the learner's device
        (a same-device handoff, `rlserve.weights.handoff`); a device tensor may be the live parameter."""

    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer, RNG, lr schedule and version, in the layout of `rlserve.learner.checkpoint`."""
        path.mkdir(parents=True, exist_ok=True)
        self._save_model_and_optimizer(path)
        torch.save(self._rng_state(), checkpoint.rng_file(path))
        if dist.get_rank() == 0:
            torch.save({"version": self._version, "scheduler": self.scheduler.state_dict()},
                       path / checkpoint.EXTRA_FILE)
        dist.barrier()

    def load_checkpoint(self, path: Path) -> int:
        """Restore what save_checkpoint wrote; returns the version."""
        self._load_model_and_optimizer(path)
        rng = checkpoint.rng_file(path)
        if rng.is_file():
            self._set_rng_state(torch.load(rng, weights_only=True))
        extra = torch.load(path / checkpoint.EXTRA_FILE, weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        self._version = int(extra["version"])
        return self._version

    def save_snapshot(self, path: Path) -> None:
        """This rank's trained state, to be restored into the same worker layout only (a learner healing a
        shared worker group snapshots after every step, so it must be cheap); a backend without a
        faster way writes a checkpoint."""
        self.save_checkpoint(path)

    def load_snapshot(self, path: Path) -> int:
        """Restore what save_snapshot wrote; returns the version."""
        return self.load_checkpoint(path)

    @abstractmethod
    def _save_model_and_optimizer(self, path: Path) -> None:
        """Write the model and optimizer state into checkpoint folder `path` (collective)."""

    @abstractmethod
    def _load_model_and_optimizer(self, path: Path) -> None:
        """Restore the model and optimizer state from checkpoint folder `path` in place (collective)."""

    def _rng_state(self) -> dict:
        """This rank's random state; a backend with generators of its own adds them."""
        return checkpoint.rng_state()

    def _set_rng_state(self, state: dict) -> None:
        checkpoint.set_rng_state(state)

    def save_hf(self, path: Path) -> None:
        """Write the policy from rank 0: an HF folder (config, tokenizer, fp32 safetensors), or with LoRA a
        PEFT adapter folder (`rlserve export --merge` merges it into its base)."""
        tensors = {name: t.contiguous() for name, t in self.export_weights(torch.float32)}
        if dist.get_rank() == 0:
            if self.adapter_config is not None:
                adapter.write_adapter(path, tensors, self.adapter_config)
            else:
                write_hf_folder(path, tensors, self.model_path, {"version": self._version})
        dist.barrier()


def datum_micro_batch(batch: DatumBatch, idx: list[int], pad_id: int, dummy: bool = False) -> MicroBatch:
    """Datums `idx` as one right-padded micro-batch whose every real position predicts its datum's target
    (the SDK's alignment: position i predicts target i, no shift). A dummy one selects no position."""
    seqs = [batch.datums[i].tokens for i in idx]
    width = max(int(s.numel()) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    real = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, s in enumerate(seqs):
        input_ids[row, :len(s)], attention[row, :len(s)] = s, 1
        real[row, :len(s)] = not dummy
    targets = (torch.cat([batch.datums[i].targets for i in idx]) if not dummy
               else torch.zeros(0, dtype=torch.long))
    lens = torch.tensor([0 if dummy else len(s) for s in seqs])
    return MicroBatch(
        input_ids=input_ids, position_ids=torch.arange(width).expand(len(seqs), width).contiguous(), packed=False,
        attention_mask=None if all(len(s) == width for s in seqs) else attention, completion_mask=real,
        hidden_index=real.flatten().nonzero().squeeze(1), targets=targets,
        advantages=torch.zeros(len(targets)), gen_logprobs=None, ref_logprobs=None,
        seq_index=torch.arange(len(seqs)).repeat_interleave(lens), num_seqs=0 if dummy else len(seqs),
        loss_mask=None, num_tokens=0 if dummy else int(lens.sum()))
