"""LoRA (Hu et al. 2021, arXiv:2106.09685) on Megatron-Core's tensor-parallel linear layers.

Written here rather than taken from a package: megatron-core 0.16.1 has no
LoRA layer; Megatron-Bridge's (`megatron.bridge.peft`, 0.3.1 being the last
release that accepts megatron-core 0.16) imports Transformer Engine
unconditionally and requires transformers < 5, mamba-ssm and TE's CUDA
wheels; NeMo 3 no longer ships its LLM collections (their LoRA moved to
Megatron-Bridge). What follows is the few lines the local layer spec needs.

Which layers. The spec names targets by the HF module names, and every HF
module gets its own adapter, A_i [r, in] and B_i [out_i, r], as in peft: the
model is the one the dtensor backend trains, and the adapters are PEFT's. Megatron
fuses some modules into one layer (`hf_map.dense_linears`): q_proj, k_proj,
v_proj -> `linear_qkv` (grouped per KV head), o_proj -> `linear_proj`,
gate_proj, up_proj -> `linear_fc1` ([gate; up], stride 2 under TP), down_proj
-> `linear_fc2` (Phi3: qkv_proj, gate_up_proj). A fused layer holds its
modules' A_i stacked, [m r, in], and their B_i fused into one B laid out
exactly like its weight's rows (`hf_map.hf_to_shard`); each output row takes
the adapter of the module it comes from (`hf_map.row_sources`, a mask per
module), and rows of modules that are not targets (k_proj in a q/v-only run)
take none and keep B = 0 (no gradient reaches them). MoE experts and routers
are not adapted.

The update y = W x + (alpha / r) B A dropout(x) is sharded like its layer over
TP, with one small extra collective of [tokens, m r]:
- column-parallel (`linear_qkv`, `linear_fc1`; rank t holds rows W_t): A is
  whole on every rank and B_t holds the same rows as W_t. h = A x is computed
  everywhere and enters B through `copy_to_tensor_model_parallel_region`, whose
  backward all-reduces dh = sum_t B_t^T dy_t: A's gradient comes out whole and
  identical on every rank, as does the LoRA part of dx.
- row-parallel (`linear_proj`, `linear_fc2`; rank t holds columns W_t and its
  input slice x_t): A_t holds the same columns, B is whole. The partial h_t =
  A_t x_t are summed by `reduce_from_tensor_model_parallel_region` (identity
  backward), so B's gradient is whole and identical on every rank and A_t's is
  its own slice.
Shards carry Megatron's `tensor_model_parallel` marks (the grad norm counts a
replicated adapter once) and checkpoint by their global coordinates, fused
gate/up B like the weight (`apply_swiglu_sharded_factory`).

The base stays frozen (requires_grad False), so Megatron's DDP gives it no
gradient buffer, its optimizer never sees it, and its layers take Megatron's
frozen-weight path (`linear_with_frozen_weight`: no weight-gradient GEMM).

Init, as peft's default: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in),
1/sqrt(in)), B = 0, so training starts from the base model. Each A_i is drawn
whole from a generator seeded by the run's seed and the module's HF name, then
sliced, so every layout starts from the same adapter. One dropout mask serves
the modules of a fused layer (peft draws one per module). Dropout of a column
layer's replicated input uses the default generator (equal on every TP rank,
as A's gradient must be); a row layer's input slices use the tensor-parallel
generator, as Megatron's attention dropout does.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.config.policy import LoraCfg
from rlserve.learner.megatron.hf_map import dense_linears, hf_names, moe_expert_leaves, row_sources
from rlserve.learner.registry import UnsupportedModel

# Megatron's column-parallel linears of a decoder layer; the others LoRA adapts are row-parallel.
_COLUMN = ("linear_qkv", "linear_fc1")


def configured_targets(cfg: LoraCfg, available: list[str]) -> list[str]:
    """The HF leaf names `cfg` asks for (`rlserve.learner.lora.target_modules`' selection)."""
    names = list(cfg.target_modules) if cfg.target_modules or not cfg.match_all_linear else sorted(available)
    return [n for n in names if n not in cfg.exclude_modules]


def layer_targets(hf_config, cfg: LoraCfg, key: str) -> dict[str, tuple[str, ...]]:
    """The layers to adapt, by path in a decoder layer (`self_attention.linear_qkv`), each with the HF modules
    of it that are targets, in fusion order; UnsupportedModel naming the field for a target it cannot adapt."""
    layers = dense_linears(hf_config)
    owner = {leaf: path for path, leaves in layers.items() for leaf in leaves}
    targets = configured_targets(cfg, list(owner))
    experts = moe_expert_leaves(hf_config)
    for name in targets:
        if name in experts:
            raise UnsupportedModel(f"{key}.target_modules", f"{name!r} is an MoE expert layer; the megatron "
                                   f"backend adapts attention and dense MLP layers only")
        if name not in owner:
            raise UnsupportedModel(f"{key}.target_modules", f"{name!r} is not a layer the megatron backend "
                                   f"adapts in this model (it adapts {', '.join(sorted(owner))})")
    chosen = {path: tuple(leaf for leaf in leaves if leaf in targets) for path, leaves in layers.items()}
    chosen = {path: leaves for path, leaves in chosen.items() if leaves}
    if not chosen:
        raise UnsupportedModel(f"{key}.exclude_modules", "excludes every target: no layer would be adapted")
    return chosen


def is_column(module: str) -> bool:
    """Whether Megatron module `...<layer>` (a LoRA target) is column-parallel."""
    return module.endswith(_COLUMN)


def initial_a(seed: int, module: str, rank: int, fan_in: int) -> torch.Tensor:
    """The whole A [rank, fan_in] of HF module `module`: peft's kaiming_uniform(a=sqrt(5)) init."""
    generator = torch.Generator().manual_seed((seed * 2**32 + zlib.crc32(module.encode())) % 2**63)
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=generator)


class LoraLinear(nn.Module):
    """A frozen ColumnParallelLinear or RowParallelLinear plus the (alpha / r) B_i A_i dropout(x) of the HF
    modules `targets` it holds, sharded like it (module docstring). `enabled` False computes the base alone.

    `a` is the modules' whole A_i stacked, [len(targets) * r, in]; `sources` (column layers) the index in
    `targets` of the module each of this rank's output rows comes from, -1 for rows of no target.
    """

    def __init__(self, base: nn.Module, cfg: LoraCfg, targets: tuple[str, ...], a: torch.Tensor,
                 sources: torch.Tensor | None, swiglu: bool):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        if not self.column and not isinstance(base, RowParallelLinear):
            raise TypeError(f"LoRA adapts Megatron's ColumnParallelLinear/RowParallelLinear, not {type(base).__name__}")
        if base.is_expert or base.sequence_parallel or (base.gather_output if self.column else
                                                        not base.input_is_parallel):
            raise NotImplementedError("LoRA adapts the local spec's dense layers without sequence parallelism")
        self.base, self.targets, self.swiglu, self.rank = base, targets, swiglu, cfg.dim
        self.tp_group = base.tp_group
        weight = base.weight  # [out/tp, in] (column) or [out, in/tp] (row)
        if not self.column:
            a = a.chunk(self.tp_group.size(), dim=1)[self.tp_group.rank()]
        self.lora_A = nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
        self.lora_B = nn.Parameter(torch.zeros(weight.shape[0], cfg.dim, device=weight.device, dtype=weight.dtype))
        set_tensor_model_parallel_attributes(self.lora_B if self.column else self.lora_A, True,
                                             0 if self.column else 1, 1)
        # One mask of output rows per module, unless a single module owns every row.
        masks = None
        if sources is not None and not bool((sources == 0).all()):
            masks = torch.stack([sources == i for i in range(len(targets))])[:, :, None].to(weight.device, weight.dtype)
        self.register_buffer("masks", masks, persistent=False)
        self.scale = cfg.alpha / cfg.dim
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else None
        self.enabled = True

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None or not self.training:
            return x
        if self.column:
            return self.dropout(x)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return self.dropout(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.base(x)
        if not self.enabled:
            return out, bias
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        h = F.linear(self._dropped(x), self.lora_A)
        if self.tp_group.size() > 1:
            h = (copy_to_tensor_model_parallel_region(h, group=self.tp_group) if self.column
                 else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        if self.masks is None:
            delta = F.linear(h, self.lora_B)
        else:  # each module's h_i through its own rows of B
            delta = sum(F.linear(h_i, self.lora_B * mask) for h_i, mask in zip(h.split(self.rank, -1), self.masks))
        return out + delta * self.scale, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The base layer's entries (under `base.`) and the adapters', by global coordinates."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = self.base.sharded_state_dict(f"{prefix}base.", sharded_offsets, metadata)
        out.update(make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B}, prefix, {"lora_B": 0} if self.column else {"lora_A": 1},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        if self.swiglu:  # [gate_t; up_t] rows, as MLP.sharded_state_dict treats linear_fc1.weight
            for key in (f"{prefix}base.weight", f"{prefix}lora_B"):
                out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                        metadata.get("singleton_local_shards", False))
        return out


def inject(gpt: nn.Module, layers: dict[str, tuple[str, ...]], cfg: LoraCfg, seed: int, hf_config) -> None:
    """Freeze `gpt` (this pipeline stage's GPTModel) and wrap the layers at `layers`' paths in every decoder
    layer in LoraLinear for their target modules; only the adapters train."""
    for param in gpt.parameters():
        param.requires_grad = False
    for layer in gpt.decoder.layers:
        for path, targets in layers.items():
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, leaf)
            weight = f"decoder.layers.{layer.layer_number - 1}.{path}.weight"
            names = hf_names(weight, hf_config)  # all the HF modules of the layer, in fusion order
            leaves = [n.split(".")[-2] for n in names]
            a = torch.cat([initial_a(seed, n.removesuffix(".weight"), cfg.dim, base.input_size)
                           for n, leaf in zip(names, leaves) if leaf in targets])
            sources = None
            if is_column(path):
                # HF module index -> target index (-1: not a target), applied to the rows this rank holds.
                to_target = torch.tensor([targets.index(leaf) if leaf in targets else -1 for leaf in leaves])
                sources = to_target[row_sources(weight, hf_config, base.tp_group.size(), base.tp_group.rank())]
            setattr(parent, leaf, LoraLinear(base, cfg, targets, a, sources,
                                             swiglu=leaf == "linear_fc1" and parent.config.gated_linear_unit))
    if gpt.pre_process and gpt.config.recompute_granularity == "full":
        # Megatron's full recompute is a reentrant autograd Function: with the embedding frozen its
        # input would not require grad, nor would any checkpointed layer's output, and the adapters
        # inside would get no gradient (HF's `enable_input_require_grads` fixes the same).
        gpt.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))


def adapters(model: nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter of `model` skipped (a LoRA run's reference policy)."""
    layers = adapters(model)
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True
