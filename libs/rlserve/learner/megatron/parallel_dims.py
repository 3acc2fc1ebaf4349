"""The one place that owns the megatron backend's parallel layout.

`choose_layout` fills the sizes that `policy.megatron_cfg` leaves at None
(automatic) and says why; `initialize` hands the layout to Megatron's
`parallel_state` (rank order tp-cp-ep-dp-pp, Megatron's default: TP peers
are neighbours, pipeline stages furthest apart).

The automatic rule, for a model of P parameters (P_e of them in experts):

- Memory per rank: weights, gradients and Adam state take B bytes per
  parameter (fp32: 4 + 4 + 8 = 16; bf16: 2 bf16 weight + 4 fp32 grad + 4 fp32
  master + 8 moments = 18), spread over the model-parallel ranks; activations
  of one micro-batch of T tokens take L * T * h * 34 bytes in 16-bit
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"; 2 * L * T * h with full recompute, x2 in fp32; their
  attention-score term is left out: attention runs in fused kernels, and packed
  rows attend per sequence without a [T, T] mask) plus the fp32 logits of one
  chunk of scored rows and its temporaries (3 * min(T, chunk rows) * vocab * 4
  bytes: `rlserve.training.forward` never holds more), spread over TP. T is
  the micro-batch's token budget: `policy.sequence_packing.train_mb_tokens`
  when packing, else micro-batch size x max_total_sequence_length. The budget
  is 80% of the device's memory (host memory on CPU test runs). The
  distributed optimizer's sharding of the Adam state over DP is left out
  (conservative).
- TP first, then PP: the smallest model-parallel degree tp * pp that fits
  (if none does, the one needing least memory, flagged in the reason);
  TP must divide the attention heads and KV groups and stay within one node
  (at most 8 or the local device count), PP must divide the layers. Pure data
  parallelism is preferred whenever the model fits, since it communicates least.
- CP stays 1: context parallelism needs the Transformer Engine attention and
  load-balanced sequence splitting that this backend does not implement.
- EP (MoE): experts spread over the data-parallel ranks, the largest size
  that divides both the experts and dp (at most 8); ETP follows TP (Megatron's
  default). Automatic TP stays 1 for MoE models unless sequence parallelism is
  on: Megatron's MoE layer refuses to train TP without SP.
- Sequence parallel is what `sequence_parallel` says, and off at TP 1
  (Megatron refuses SP without TP).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from rlserve.config.policy import MegatronCfg
from rlserve.models.architecture import num_experts
from rlserve.training.forward import default_chunk_rows

log = logging.getLogger(__name__)

_BUDGET = 0.8
_MAX_TP = 8


@dataclass(frozen=True)
class ModelShape:
    """What the layout rule needs to know about the model."""

    num_parameters: int
    expert_parameters: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_experts: int

    @classmethod
    def from_hf(cls, hf_config, num_parameters: int) -> ModelShape:
        experts = num_experts(hf_config)
        ffn = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        per_expert = 3 * hf_config.hidden_size * ffn
        return cls(num_parameters, experts * per_expert * hf_config.num_hidden_layers, hf_config.num_hidden_layers,
                   hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads,
                   hf_config.vocab_size, experts)


@dataclass(frozen=True)
class MegatronLayout:
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    world_size: int
    sequence_parallel: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if self.tp * self.pp * self.cp * self.dp != self.world_size:
            raise ValueError(f"tp ({self.tp}) * pp ({self.pp}) * cp ({self.cp}) * dp ({self.dp}) must equal "
                             f"the world size ({self.world_size})")
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"expert_model_parallel_size ({self.ep}) * expert_tensor_parallel_size ({self.etp}) "
                             f"must divide tp * cp * dp ({self.tp * self.cp * self.dp})")

    def describe(self) -> str:
        sizes = f"tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep} etp={self.etp} dp={self.dp}"
        sizes += " sp" if self.sequence_parallel else ""
        return f"{sizes} ({self.reason})" if self.reason else sizes


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def choose_layout(cfg: MegatronCfg, model: ModelShape, world_size: int, memory_bytes: int, tokens_per_micro_batch: int,
                  precision: str, devices_per_node: int) -> MegatronLayout:
    """Sizes from `cfg`, with those left at None chosen by the rule in the module docstring."""
    if cfg.context_parallel_size not in (None, 1):
        raise NotImplementedError("policy.megatron_cfg.context_parallel_size > 1: context parallelism needs the "
                                  "Transformer Engine attention and sequence splitting, which this backend does "
                                  "not implement; use tensor/sequence parallelism for long sequences")
    cp = 1
    bytes_per_param = 16 if precision == "float32" else 18
    act_scale = (2 if cfg.activation_checkpointing else 34) * (2 if precision == "float32" else 1)
    activations = model.num_layers * tokens_per_micro_batch * model.hidden_size * act_scale
    activations += 3 * min(tokens_per_micro_batch, default_chunk_rows(model.vocab_size)) * model.vocab_size * 4
    dense = model.num_parameters - model.expert_parameters
    budget = _BUDGET * memory_bytes

    def need(tp: int, pp: int, ep: int, etp: int) -> float:
        state = bytes_per_param * (dense / (tp * pp) + model.expert_parameters / (ep * etp * pp))
        return state + activations / tp

    def auto_ep(pp: int, etp: int) -> int:
        if not model.num_experts:
            return 1
        room = world_size // (pp * cp * etp)  # ep * etp must divide tp * cp * dp
        return max(d for d in _divisors(math.gcd(model.num_experts, room)) if d <= _MAX_TP)

    tp_options = [cfg.tensor_model_parallel_size] if cfg.tensor_model_parallel_size else [
        t for t in _divisors(world_size)
        if t <= min(_MAX_TP, devices_per_node) and model.num_heads % t == 0 and model.num_kv_heads % t == 0
        # Megatron's MoE layer trains TP only with sequence parallelism.
        and (t == 1 or not model.num_experts or cfg.sequence_parallel)]
    candidates = []
    for tp in tp_options:
        pp_options = [cfg.pipeline_model_parallel_size] if cfg.pipeline_model_parallel_size else [
            p for p in _divisors(world_size // tp if world_size % tp == 0 else 1) if model.num_layers % p == 0]
        for pp in pp_options:
            if world_size % (tp * pp * cp):
                continue
            etp = cfg.expert_tensor_parallel_size or tp
            ep = cfg.expert_model_parallel_size or auto_ep(pp, etp)
            candidates.append((tp * pp, pp, tp, ep, etp))
    if not candidates:
        raise ValueError(f"no Megatron layout of {world_size} ranks fits policy.megatron_cfg (tp="
                         f"{cfg.tensor_model_parallel_size}, pp={cfg.pipeline_model_parallel_size}); tp * pp * cp "
                         f"must divide the world size")
    candidates.sort()
    fitting = [c for c in candidates if need(c[2], c[1], c[3], c[4]) <= budget]
    best = fitting[0] if fitting else min(candidates, key=lambda c: need(c[2], c[1], c[3], c[4]))
    _, pp, tp, ep, etp = best
    estimate = (f"~{_fmt_gib(need(tp, pp, ep, etp))} per rank for {_fmt_count(model.num_parameters)} params "
                f"and {tokens_per_micro_batch} tokens per micro-batch, budget {_fmt_gib(budget)}")
    automatic = [name for name, v in (("tp", cfg.tensor_model_parallel_size), ("pp", cfg.pipeline_model_parallel_size),
                                      ("ep", cfg.expert_model_parallel_size if model.num_experts else 1))
                 if v is None]
    if not automatic:
        reason = f"as configured; {estimate}"
    elif fitting:
        reason = f"auto {'/'.join(automatic)}: smallest model-parallel size that fits, {estimate}"
    else:
        reason = f"auto {'/'.join(automatic)}: NOTHING FITS, took the layout needing least memory, {estimate}"
    sp = cfg.sequence_parallel and tp > 1
    if cfg.sequence_parallel and not sp:
        reason += "; sequence_parallel off at tp=1"
    return MegatronLayout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=world_size // (tp * pp * cp),
                          world_size=world_size, sequence_parallel=sp, reason=reason)


def initialize(layout: MegatronLayout, seed: int) -> None:
    """Megatron's process groups for `layout` (re-created if a previous backend left some) and its RNG streams."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)
