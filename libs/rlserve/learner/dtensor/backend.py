"""The DTensor/FSDP2 learner backend: an HF model, sharded with FSDP2 over the
data-parallel dim and DTensor tensor parallel over the tensor dim."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlserve.config.spec import RunSpec
from rlserve.dtypes import torch_dtype
from rlserve.learner import lora
from rlserve.learner.dtensor import checkpoint, snapshot, weights
from rlserve.learner.dtensor.parallel_dims import ParallelDims
from rlserve.learner.dtensor.parallelize import parallelize
from rlserve.learner.interfaces import BackendInfo, LearnerBackend
from rlserve.learner.shared_base import BaseShare
from rlserve.models import moe_routing
from rlserve.models.architecture import OutputLogits, load_causal_lm
from rlserve.training.attention import register_hf_attention, unsupported_reason
from rlserve.training.batch import MicroBatch
from rlserve.training.forward import gather_logprobs
from rlserve.training.objective import StepObjective
from rlserve.training.schedule import lr_factor
from rlserve.weights import adapter
from rlserve.weights.specs import checkpoint_specs


class PolicyLogprobs(nn.Module):
    """Root module for FSDP: runs the decoder and returns logprobs of completion tokens only.

    Wrapping the HF model lets the FSDP root gather the embeddings, final norm and head
    before this forward, while the vocabulary projection covers only completion positions
    (followed by the model's own logit soft-capping or scaling, as its ForCausalLM does).
    With `maskless` the model attends through `rlserve.training.attention` (packed rows per
    sequence from their cu_seqlens, right-padded rows causally), so no [T, T] mask is ever built;
    otherwise transformers builds its masks (the block-diagonal one from the packed positions).
    """

    def __init__(self, lm: nn.Module, maskless: bool):
        super().__init__()
        self.lm, self.maskless = lm, maskless
        self.output_logits = OutputLogits.from_config(lm.config)

    def forward(self, mb: MicroBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Packed rows need their restarting positions (RoPE restarts per sequence); padded rows use
        # the default positions.
        extra = mb.attention_kwargs() if self.maskless else {}
        out = self.lm.model(input_ids=mb.input_ids, position_ids=mb.position_ids if mb.packed else None,
                            attention_mask=None if self.maskless else mb.attention_mask, use_cache=False, **extra)
        hidden = out.last_hidden_state
        if isinstance(hidden, DTensor):  # sequence parallel leaves it sharded along the sequence
            hidden = hidden.full_tensor()
        head = self.lm.get_output_embeddings().weight
        rows = hidden.flatten(0, 1).index_select(0, mb.hidden_index)
        return gather_logprobs(rows, head, mb.targets, with_entropy=with_entropy,
                               logits_fn=None if self.output_logits.identity else self.output_logits)


class DTensorBackend(LearnerBackend):
    name = "dtensor"
    shares_base = True  # LoRA runs hold their frozen base once (`rlserve.learner.shared_base`)

    def __init__(self, spec: RunSpec, model_path: Path, device: torch.device, init_adapter: Path | None = None,
                 shared: BaseShare | None = None):
        from transformers import AutoConfig

        self.spec, self.model_path, self.device = spec, Path(model_path), device
        cfg = spec.policy.dtensor_cfg
        self.dims = ParallelDims.from_world(dist.get_world_size(), cfg.tensor_parallel_size)
        self.mesh = self.dims.build_mesh(device.type)
        self.dp_size, self.dp_rank = self.dims.dp, self.mesh["dp"].get_local_rank()
        self.param_dtype = torch_dtype(spec.policy.precision)
        torch.manual_seed(spec.grpo.seed)

        config = AutoConfig.from_pretrained(self.model_path)
        self.attention_fallback = unsupported_reason(config)
        lm = load_causal_lm(self.model_path, torch.float32,
                            attn=None if self.attention_fallback else register_hf_attention())
        lm.config.use_cache = False
        self.pad_id = lm.config.pad_token_id or 0
        self.num_parameters = sum(p.numel() for p in lm.parameters())
        self.export_names = set(checkpoint_specs(self.model_path))
        self.adapter_config = None
        if spec.policy.lora.enabled:
            targets = lora.target_modules(spec.policy.lora, lora.decoder_linears(lm), spec.policy.lora_key)
            lora.inject(lm, spec.policy.lora, targets)
            self.adapter_config = lora.adapter_config(spec.policy.lora, targets, str(self.model_path))
            # The frozen base is kept in the learner's precision; the adapters in fp32 (mixed precision
            # casts them for compute).
            for name, param in lm.named_parameters():
                if not param.requires_grad:
                    param.data = param.data.to(self.param_dtype)
        lm.to(device)
        self.model = PolicyLogprobs(lm, maskless=self.attention_fallback is None)
        share = shared is not None and self.adapter_config is not None
        parallelize(self.model, lm, self.mesh, cfg, self.param_dtype, frozen_outside=share)
        self.shared_bytes = shared.share(self.model) if share else 0
        self.accumulate_unsharded = self.dims.dp == 1 and not cfg.cpu_offload
        if init_adapter is not None:
            self._load_adapter(init_adapter)

        opt = spec.policy.optimizer.kwargs
        # Only what trains reaches the optimizer: with LoRA its state is adapter-sized.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._snapshot_host: dict[str, torch.Tensor] = {}  # host buffers `save_snapshot` reuses
        self.optimizer = torch.optim.AdamW(self.trainable, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                           weight_decay=opt.weight_decay, foreach=True)
        sched, total = spec.policy.scheduler, spec.max_num_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, sched, total))
        self._version = 0

    # --- contract ------------------------------------------------------------

    def info(self) -> BackendInfo:
        attention = (f"transformers attention ({self.attention_fallback})" if self.attention_fallback
                     else "maskless packed attention")
        adapters = (f"; LoRA r={self.adapter_config['r']} on {','.join(self.adapter_config['target_modules'])}, "
                    f"{sum(p.numel() for p in self.trainable) / 1e6:.2f}M trainable" if self.adapter_config else "")
        if self.shared_bytes:
            adapters += f"; frozen base shared with other runs ({self.shared_bytes / 2**20:.1f} MiB not held again)"
        return BackendInfo(self.name, self.dims.world_size, f"{self.dims.describe()}; {attention}{adapters}",
                           self.num_parameters, str(self.device))

    def _run_updates(self, objective: StepObjective) -> list[torch.Tensor]:
        prev = self._prev_logprobs(objective) if objective.needs_prev_logprobs else None
        grad_norms = []
        for k, plan in enumerate(objective.plans):
            self.optimizer.zero_grad(set_to_none=True)
            for j, mb in enumerate(plan):
                # With several data-parallel ranks every micro-batch reduce-scatters its gradients,
                # which bounds gradient memory to a shard. With one rank the full gradient is the
                # shard, so accumulate it unsharded and reduce once per optimizer update.
                if self.accumulate_unsharded:
                    self.model.set_requires_gradient_sync(j == len(plan) - 1)
                mb = mb.to(self.device)
                # MoE routing replay holds through backward too (activation checkpointing recomputes).
                with moe_routing.replay(self.model.lm, moe_routing.rows(mb.routed_experts)):
                    lps, entropy = self.model(mb, with_entropy=True)
                    loss_value = objective.micro_batch_loss(k, mb, lps, None if prev is None else prev[k][j],
                                                            entropy)
                    # FSDP averages gradients over data-parallel ranks; the loss is already
                    # normalised by global counts, so undo that average.
                    (loss_value * self.dims.dp).backward()
            grad_norms.append(self._clip_and_step())
        return grad_norms

    def _finalize(self, objective: StepObjective) -> dict[str, float]:
        return objective.finalize(self.mesh["dp"].get_group())

    @torch.no_grad()
    def _prev_logprobs(self, objective: StepObjective) -> list[list[torch.Tensor | None]]:
        """Logprobs under the weights at the start of the step, for steps of several optimizer updates."""
        return objective.prev_logprobs(lambda plan: [self._logprobs(mb) for mb in plan])

    def _reference_logprobs(self, objective: StepObjective) -> list[list[torch.Tensor]]:
        with lora.adapters_off(self.model):
            return [[self._logprobs(mb) for mb in plan] for plan in objective.plans]

    def _logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """A micro-batch's logprobs without entropy (forward only), replaying its MoE routing if it has any."""
        with moe_routing.replay(self.model.lm, moe_routing.rows(mb.routed_experts)):
            return self.model(mb.to(self.device), with_entropy=False)[0]

    def _load_adapter(self, folder: Path) -> None:
        """Start from a trained adapter (a LoRA run's SFT warm start): its tensors into the adapter parameters."""
        tensors = lora.read_adapter_for(folder, self.adapter_config)
        weights.load_adapter(self.model, {adapter.param_name(n): t for n, t in tensors.items()})

    def _datum_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        # Every call reduces its gradients (no deferred sync): they add up across forward_backward calls.
        self.model.set_requires_gradient_sync(True)
        return self.model(mb.to(self.device), with_entropy=False)[0]

    def _primitive_step(self, max_norm: float | None) -> torch.Tensor:
        if all(p.grad is None for p in self.trainable):  # no forward_backward since the last step
            return torch.zeros(())
        norm = clip_grad_norm(self.trainable, max_norm)
        self.optimizer.step()
        return norm

    def _clip_and_step(self) -> torch.Tensor:
        norm = clip_grad_norm(self.trainable, self.spec.policy.max_grad_norm)
        self.optimizer.step()
        return norm

    def export_weights(self, dtype: torch.dtype | None = None, on_device: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        if self.adapter_config is not None:
            return weights.export_adapter(self.model, dtype, on_device)
        return weights.export_weights(self.model, self.model.lm, self.export_names,
                                      self.model.lm.config.tie_word_embeddings, dtype, on_device)

    def _save_model_and_optimizer(self, path: Path) -> None:
        checkpoint.save(path, self.model, self.optimizer)

    def save_snapshot(self, path: Path) -> None:
        snapshot.save(path, self.model, self.optimizer, {"rng": self._rng_state(), "version": self._version,
                                                         "scheduler": self.scheduler.state_dict()},
                      self._snapshot_host)

    def load_snapshot(self, path: Path) -> int:
        extra = snapshot.load(path, self.model, self.optimizer)
        self._set_rng_state(extra["rng"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self._version = int(extra["version"])
        return self._version

    def _load_model_and_optimizer(self, path: Path) -> None:
        checkpoint.load(path, self.model, self.optimizer)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of the gradients (clipped to max_norm when given).

    Under FSDP + TP parameters live on different meshes (replicated ones on the dp mesh, TP-sharded
    ones on the dp x tp mesh), which torch's clip_grad_norm_ cannot stack; norms are taken per mesh
    and combined here.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm:
        # Scale the local shards directly: gradients are Shard/Replicate DTensors after FSDP's
        # reduce-scatter, so this is exact, and it avoids mixing meshes in one foreach call.
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for group in by_mesh.values() for g in group]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return total.detach()  # stays on the device: no sync between backward and the optimizer step
