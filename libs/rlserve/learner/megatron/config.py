"""Megatron-Core configs built from the run spec, and the checked passthrough of extra keys.

`policy.megatron_cfg` has a few fields of its own (parallel sizes, sequence
parallel, activation checkpointing, the distributed optimizer, the layer
implementation); every other key under it is forwarded to whichever of
Megatron's `TransformerConfig`, `DistributedDataParallelConfig` and
`OptimizerConfig` has a field of that name (to each one that has it), as
NeMo-RL forwards its megatron_cfg. The NeMo-RL sub-sections
`megatron_cfg.optimizer: {...}` and `megatron_cfg.distributed_data_parallel_config: {...}`
are accepted too and go to that one config only.

A key that no config has is an error naming the closest field names. Keys that
rlserve sets from elsewhere are errors too, naming where to set them: the model
architecture comes from the HF config, the learning rate, betas, eps, weight
decay and clipping from `policy.optimizer` / `policy.max_grad_norm`, precision
from `policy.precision`, parallel sizes from the megatron_cfg fields.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import torch

from rlserve.config.policy import MegatronCfg
from rlserve.config.spec import RunSpec
from rlserve.dtypes import torch_dtype

_NESTED = {"optimizer": "optimizer", "distributed_data_parallel_config": "ddp"}

# Keys rlserve sets itself, and where a user sets them instead.
_OWNED = {
    "lr": "policy.optimizer.kwargs.lr",
    "weight_decay": "policy.optimizer.kwargs.weight_decay",
    "adam_beta1": "policy.optimizer.kwargs.betas",
    "adam_beta2": "policy.optimizer.kwargs.betas",
    "adam_eps": "policy.optimizer.kwargs.eps",
    "clip_grad": "policy.max_grad_norm",
    "bf16": "policy.precision",
    "fp16": "policy.precision",
    "params_dtype": "policy.precision",
    "pipeline_dtype": "policy.precision",
    "tensor_model_parallel_size": "policy.megatron_cfg.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "policy.megatron_cfg.pipeline_model_parallel_size",
    "context_parallel_size": "policy.megatron_cfg.context_parallel_size",
    "expert_model_parallel_size": "policy.megatron_cfg.expert_model_parallel_size",
    "expert_tensor_parallel_size": "policy.megatron_cfg.expert_tensor_parallel_size",
    "sequence_parallel": "policy.megatron_cfg.sequence_parallel",
    "use_distributed_optimizer": "policy.megatron_cfg.use_distributed_optimizer",
    "calculate_per_token_loss": "the backend (losses are normalised by global token counts in rlserve's objective)",
    "variable_seq_lengths": "the backend (it pads the micro-batches of a pipeline schedule to one shape)",
}

# TransformerConfig fields that `megatron_config_from_hf` derives from the HF config.
_ARCHITECTURE = {
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
    "add_qkv_bias", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
    "moe_router_pre_softmax", "rotary_interleaved",
}


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _megatron_classes() -> dict[str, type]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {"transformer": TransformerConfig, "ddp": DistributedDataParallelConfig, "optimizer": OptimizerConfig}


def _coerce(cls: type, key: str, value: Any) -> Any:
    """YAML gives strings where a Megatron field wants a torch dtype ("bfloat16" -> torch.bfloat16)."""
    f = _fields(cls)[key]
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(value, str) and (isinstance(default, torch.dtype) or "dtype" in str(f.type)):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return value


@dataclass
class Passthrough:
    """Extra keys of `policy.megatron_cfg`, checked and sorted by the Megatron config they go to."""

    transformer: dict[str, Any] = field(default_factory=dict)
    ddp: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_cfg(cls, cfg: MegatronCfg) -> Passthrough:
        """Raises ValueError for unknown keys (with close matches) and for keys rlserve sets itself."""
        classes = _megatron_classes()
        fields = {name: _fields(c) for name, c in classes.items()}
        every = sorted({k for fs in fields.values() for k in fs} | set(MegatronCfg.model_fields) | set(_NESTED))
        out, problems = cls(), []

        def place(key: str, value: Any, targets: list[str], where: str) -> None:
            if key in _OWNED:
                problems.append(f"{where}{key}: set by {_OWNED[key]}, not forwarded to Megatron")
            elif key in _ARCHITECTURE:
                problems.append(f"{where}{key}: the model architecture comes from the HF config of "
                                f"policy.model_name")
            else:
                hits = [t for t in targets if key in fields[t]]
                if not hits:
                    pool = sorted({k for t in targets for k in fields[t]}) if where else every
                    close = difflib.get_close_matches(key, pool, n=3, cutoff=0.6)
                    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
                    names = ", ".join(classes[t].__name__ for t in targets)
                    problems.append(f"{where}{key}: unknown key (not a field of Megatron's {names}){hint}")
                for t in hits:
                    getattr(out, t)[key] = _coerce(classes[t], key, value)

        for key, value in cfg.passthrough().items():
            if key in _NESTED and isinstance(value, dict):
                for sub, sub_value in value.items():
                    place(sub, sub_value, [_NESTED[key]], f"{key}.")
            else:
                place(key, value, ["transformer", "ddp", "optimizer"], "")
        if problems:
            raise ValueError("policy.megatron_cfg: " + "; ".join(problems))
        return out


def use_transformer_engine(cfg: MegatronCfg) -> bool:
    """`transformer_impl`: "auto" takes the TE layer spec when transformer_engine imports, except with LoRA,
    which adapts the local spec's layers (`rlserve.learner.megatron.support.check_model` refuses TE with it)."""
    if cfg.transformer_impl == "local" or cfg.peft.enabled:
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if cfg.transformer_impl == "transformer_engine":
            raise RuntimeError("policy.megatron_cfg.transformer_impl is 'transformer_engine' but "
                               "transformer_engine does not import here") from None
        return False
    return True


def param_dtype(spec: RunSpec) -> torch.dtype:
    return torch_dtype(spec.policy.precision)


def transformer_overrides(spec: RunSpec, layout, passthrough: Passthrough) -> dict[str, Any]:
    """Keyword overrides for `megatron_config_from_hf`: layout, precision, recompute, then passthrough."""
    dtype = param_dtype(spec)
    overrides: dict[str, Any] = dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        # Weights come from the HF checkpoint right after construction, but the random init must
        # run: in megatron-core 0.16.1 it is what marks parameters `tensor_model_parallel` (and
        # their partition dim), without which the grad norm counts TP shards on TP rank 0 only.
        perform_initialization=True,
        use_cpu_initialization=False,
        # Pipeline stages get one padded shape per minibatch (forward.py), never per-micro-batch shapes.
        variable_seq_lengths=False,
        # rlserve's objective divides each micro-batch loss by global counts itself.
        calculate_per_token_loss=False,
    )
    if spec.policy.megatron_cfg.activation_checkpointing:
        # NeMo-RL's meaning of activation_checkpointing: full recompute of every layer.
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.policy.routing_replay:
        overrides["moe_enable_routing_replay"] = True  # a RouterReplay per router (`megatron/routing.py`)
    overrides.update(passthrough.transformer)
    return overrides


def ddp_config(spec: RunSpec, passthrough: Passthrough):
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs: dict[str, Any] = dict(
        # bf16 gradients accumulate and reduce in fp32, as FSDP2's reduce_dtype does in the dtensor backend.
        grad_reduce_in_fp32=spec.policy.precision != "float32",
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=spec.policy.megatron_cfg.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    kwargs.update(passthrough.ddp)
    return DistributedDataParallelConfig(**kwargs)


def optimizer_config(spec: RunSpec, passthrough: Passthrough):
    """Adam with decoupled weight decay (AdamW), as `policy.optimizer` says; clipping from max_grad_norm."""
    from megatron.core.optimizer import OptimizerConfig

    opt = spec.policy.optimizer.kwargs
    dtype = param_dtype(spec)
    kwargs: dict[str, Any] = dict(
        optimizer="adam",
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_eps=opt.eps,
        decoupled_weight_decay=True,
        clip_grad=spec.policy.max_grad_norm or 0.0,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        params_dtype=dtype,
        use_distributed_optimizer=spec.policy.megatron_cfg.use_distributed_optimizer,
    )
    kwargs.update(passthrough.optimizer)
    return OptimizerConfig(**kwargs)
