"""Apply tensor parallel -> activation checkpointing -> FSDP2 to an HF decoder-only model.

The order is torchtitan's (models/llama3/parallelize.py): TP first so that
FSDP shards the already TP-sharded DTensors along the data-parallel dim.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rlserve.config.policy import DTensorCfg
from rlserve.logs import event

log = logging.getLogger(__name__)


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(lm).__name__}: expected an HF decoder-only model with model.layers")
    return layers


_SPLIT_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_SPLIT_MLP = ("gate_proj", "up_proj", "down_proj")


def _has(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Every projection is a Linear (or peft's LoRA layer around one)."""
    return all(isinstance(getattr(getattr(module, n, None), "base_layer", getattr(module, n, None)), nn.Linear)
               for n in names)


def replicated_blocks(lm: nn.Module) -> list[str]:
    """Attention/MLP blocks tensor parallel leaves whole on every TP rank (the plan's exceptions).

    Megatron-style TP needs separate projections: HF's own fused ones (Phi3's `qkv_proj` =
    [Q; K; V] and `gate_up_proj` = [gate; up]) split column-wise would hand each rank rows of
    one part only, and transformers 5's fused MoE experts (3-D `gate_up_proj`/`down_proj`)
    are not Linear modules. Those blocks run replicated (FSDP still shards their parameters
    over data-parallel ranks), which is exact; only their memory is not divided by TP.
    """
    layer = decoder_layers(lm)[0]
    out = []
    if not _has(layer.self_attn, _SPLIT_ATTENTION):
        out.append("self_attn")
    if not _has(layer.mlp, _SPLIT_MLP):
        out.append("mlp")
    return out


def _head_norm_plan(attn: nn.Module) -> dict:
    """Per-head norms inside split attention (Qwen3's and Gemma3's q_norm/k_norm).

    Each TP rank normalises its own heads with a weight every head shares, so the weight's
    gradient is a sum over all heads: over both ranks. Declaring the norm's input sharded (the
    style named SequenceParallel) makes the weight a replicated DTensor whose gradient DTensor
    all-reduces. Which non-last dim is declared does not matter to an RMSNorm over the last dim
    (the weight gradient sums over every other element anyway); dim 1 is heads for Gemma3's
    [b, heads, s, d] and the sequence for Qwen3's [b, s, heads, d]. transformers' own TP plan
    marks these norms `replicated_with_grad_allreduce` for the same reason.
    """
    return {f"self_attn.{name}": SequenceParallel(sequence_dim=1, use_local_output=True)
            for name, _ in attn.named_children() if name.endswith("norm")}


def _projections(layer: nn.Module, styles: dict[str, str], row: dict) -> dict:
    """The TP plan of split projections ("col" or "row"), LoRA-adapted ones included.

    An adapted projection (peft's LoRA layer) keeps its base layer's style; of its adapter
    x -> B A x, the factor on the split dim is split like the layer and the other stays whole on
    every rank: column-wise, B is split by output rows and A (r x in) is whole, its input and
    output equal on every rank (the gradient of A's output arrives summed over ranks, from B's
    column-wise input); row-wise, A is split by input columns (its r outputs summed over ranks)
    and B (out x r) is whole.
    """
    plan = {}
    for path, kind in styles.items():
        module = layer.get_submodule(path)
        style = ColwiseParallel() if kind == "col" else RowwiseParallel(**row)
        if not hasattr(module, "base_layer"):
            plan[path] = style
            continue
        plan[f"{path}.base_layer"] = style
        if kind == "col":
            plan[f"{path}.lora_B.default"] = ColwiseParallel()
        else:
            plan[f"{path}.lora_A.default"] = RowwiseParallel()
    return plan


def _block_plan(name: str, split: bool, projections: dict, sequence_parallel: bool, seq) -> dict:
    """One attention or MLP block: split projections, or a whole block between the TP regions."""
    plan = dict(projections) if split else {}
    if not sequence_parallel:
        return plan  # inputs and outputs are plain tensors, equal on every TP rank
    inputs = ({"input_kwarg_layouts": {"hidden_states": seq},
               "desired_input_kwarg_layouts": {"hidden_states": Replicate()}} if name == "self_attn" else
              {"input_layouts": (seq,), "desired_input_layouts": (Replicate(),)})
    if split:
        plan[name] = PrepareModuleInput(**inputs)
    else:  # gather the sequence for the whole block, then back to sequence shards for the norms
        outputs = (Replicate(), None) if name == "self_attn" else (Replicate(),)
        plan[name] = PrepareModuleInputOutput(**inputs, use_local_input=True, output_layouts=outputs,
                                              desired_output_layouts=(seq, None) if name == "self_attn" else (seq,),
                                              use_local_output=False)
    return plan


def apply_tp(lm: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron-style TP on attention and MLP projections; embeddings and head stay replicated.

    Attention heads and KV groups are split across TP ranks (q/k/v column-wise, o row-wise);
    HF's attention infers the local head count from the projection width; per-head norms act on
    local heads with their gradient summed over ranks (`_head_norm_plan`). Blocks without
    separate projections stay whole (`replicated_blocks`, logged). With sequence parallel, every norm of the layer (Gemma's
    sandwich norms included) and the residuals hold sequence shards between the TP regions.
    """
    tp = tp_mesh.size()
    whole = replicated_blocks(lm)
    heads, kv_heads = lm.config.num_attention_heads, lm.config.num_key_value_heads
    if "self_attn" not in whole and (heads % tp or kv_heads % tp):
        raise ValueError(f"tensor_parallel_size {tp} must divide the attention heads ({heads}) "
                         f"and KV heads ({kv_heads})")
    if whole:
        event(log, "learner.tp_blocks_whole", blocks=",".join(whole), model_type=lm.config.model_type,
              reason="no separate projections (HF-fused or MoE experts); replicated over TP ranks")
    seq = Shard(1)
    out_layout = seq if sequence_parallel else Replicate()
    for layer in decoder_layers(lm):
        row = {"output_layouts": out_layout, "use_local_output": not sequence_parallel}
        attention = _projections(layer, {"self_attn.q_proj": "col", "self_attn.k_proj": "col",
                                         "self_attn.v_proj": "col", "self_attn.o_proj": "row"}, row) \
            if "self_attn" not in whole else {}
        attention.update(_head_norm_plan(layer.self_attn))
        plan = _block_plan("self_attn", "self_attn" not in whole, attention, sequence_parallel, seq)
        mlp = _projections(layer, {"mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}, row) \
            if "mlp" not in whole else {}
        plan.update(_block_plan("mlp", "mlp" not in whole, mlp, sequence_parallel, seq))
        if sequence_parallel:
            plan.update({name: SequenceParallel() for name, child in layer.named_children()
                         if name.endswith("norm")})
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel:
        parallelize_module(lm.model, tp_mesh, {
            "embed_tokens": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq,
                                                use_local_output=False),
            "norm": SequenceParallel(use_local_output=False),
        })


def checkpointed_layers(num_layers: int, fraction: float) -> list[int]:
    """The layers that checkpoint, `fraction` of them spread evenly: (16, 0.25) -> [3, 7, 11, 15]."""
    return [i for i in range(num_layers) if int((i + 1) * fraction + 1e-9) > int(i * fraction + 1e-9)]


def apply_activation_checkpointing(lm: nn.Module, fraction: float) -> None:
    """Those layers keep only their input; backward recomputes the rest."""
    layers = decoder_layers(lm)
    for i in checkpointed_layers(len(layers), fraction):
        layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)


def apply_fsdp(root: nn.Module, lm: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype,
               cpu_offload: bool, frozen_outside: bool = False) -> None:
    """FSDP2 per decoder layer, then the root (embeddings, final norm, head: tied weights share a unit).
    `frozen_outside`: frozen parameters stay whole on every rank, outside FSDP (a LoRA base shared
    between runs, `rlserve.learner.shared_base`)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp}
    if frozen_outside:
        kwargs["ignored_params"] = {p for p in root.parameters() if not p.requires_grad}
    if cpu_offload:
        if dp_mesh.device_type != "cuda":
            raise ValueError("policy.dtensor_cfg.cpu_offload: offloads GPU parameters to host memory; "
                             "this learner already runs on the CPU")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(lm)
    # Resharding after forward frees the gathered copy until backward gathers it again. With one
    # data-parallel rank (and the weights on the GPU) there is nothing to save: keep it gathered.
    # Otherwise keep the last layer's gathered anyway: the backward needs it right away.
    keep_gathered = dp_mesh.size() == 1 and not cpu_offload
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=not keep_gathered and i < len(layers) - 1, **kwargs)
    fully_shard(root, reshard_after_forward=not keep_gathered, **kwargs)


def parallelize(root: nn.Module, lm: nn.Module, mesh: DeviceMesh, cfg: DTensorCfg, param_dtype: torch.dtype,
                frozen_outside: bool = False) -> None:
    if mesh["tp"].size() > 1:
        apply_tp(lm, mesh["tp"], cfg.sequence_parallel)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(lm, cfg.activation_checkpointing_fraction)
    apply_fsdp(root, lm, mesh["dp"], param_dtype, cfg.cpu_offload, frozen_outside)
