"""The megatron backend's part of a checkpoint (layout: `rlserve.learner.checkpoint`).

- `megatron/`: `megatron.core.dist_checkpointing` ("torch_dist", i.e. torch
  DCP underneath) of `{"model": model.sharded_state_dict(), "optimizer":
  optimizer.sharded_state_dict(...)}`. Model tensors are stored by their
  global (unsharded) coordinates, so the weights load under another TP/PP/EP/DP
  layout. The optimizer state (Adam moments, fp32 main params, step) of the
  distributed optimizer is stored in its bucket layout ("dp_reshardable"), so it
  reloads under another DP size only; the non-distributed optimizer's state is
  per parameter. A LoRA run saves its adapters only (`trainable_only`): the
  frozen base comes from the model folder.
- In each rank's random state, beside the CPU and CUDA generators: Megatron's
  tensor-parallel RNG tracker (`tracker_state`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

# The distributed optimizer's format. In megatron-core 0.16.1 with torch's Adam (no Apex/TE) the
# fully reshardable formats fail: "fully_sharded_model_space" (the default) refuses to build
# ("ShardedTensor.flattened_range is not supported") and "fully_reshardable" loads without the
# per-parameter "step" that torch's Adam keeps (KeyError). "dp_reshardable" works (see load()).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded(model, optimizer, is_loading: bool, trainable_only: bool) -> dict:
    """`model` is the GPTModel itself (the DDP wrapper would prefix every key with "module.")."""
    model_sd = model.sharded_state_dict()
    if trainable_only:  # frozen tensors (a LoRA run's base) come from the model folder
        model_sd = {k: v for k, v in model_sd.items() if getattr(getattr(v, "data", None), "requires_grad", False)}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIMIZER_METADATA)}


def tracker_state() -> dict:
    """Megatron's tensor-parallel RNG tracker (the generators of TP-sharded dropout and init)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def set_tracker_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(state)


def save(path: Path, model, optimizer, trainable_only: bool) -> None:
    from megatron.core import dist_checkpointing

    folder = path / "megatron"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(model, optimizer, False, trainable_only), str(folder))


def _allocate_adam_state(optimizer) -> None:
    """Give a never-stepped torch Adam(W) its state tensors, which the load then overwrites.

    megatron-core 0.16.1's DistributedOptimizer.state_dict() reads the step of every parameter's
    state and asserts there is exactly one value; with torch's Adam (no Apex/TE, as on CPU or a GPU
    image without them) a fresh optimizer has no state yet, so building the sharded state dict for
    loading fails before anything is read.
    """
    for inner in _torch_adams(optimizer):
        if len(inner.state):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    inner = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inner if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]


def _restore_adam_steps(optimizer) -> None:
    """Put the checkpoint's step count back into a torch Adam(W)'s per-parameter state.

    megatron-core 0.16.1's DistributedOptimizer keeps the step of a torch optimizer in its param
    groups (`group["step"]`, which it restores), then overwrites the per-parameter "step" that
    torch's Adam reads with the loading template's value while it copies the moments.
    """
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def load(path: Path, model, optimizer, trainable_only: bool) -> None:
    """Restore model and optimizer in place (with `trainable_only`, the model's trained parameters only)."""
    from megatron.core import dist_checkpointing

    _allocate_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded(model, optimizer, True, trainable_only), str(path / "megatron"))
    result = model.load_state_dict(state["model"], strict=not trainable_only)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if result.unexpected_keys or trained & set(result.missing_keys):
        raise KeyError(f"checkpoint mismatch: unexpected {result.unexpected_keys[:4]}, "
                       f"missing {sorted(trained & set(result.missing_keys))[:4]}")
    with torch.no_grad():  # the distributed optimizer copies into fp32 shards that are views of leaf params
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(optimizer)
