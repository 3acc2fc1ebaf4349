"""The frozen base weights of LoRA runs, held once per learner process for every run on that base.

Runs on the deployed base (`RunSpec.shares_deployed_base`) train in the same
learner workers at once. Each builds its model as usual, then `share` swaps
each frozen parameter for the copy an earlier run of the same base already
holds (or keeps its own as that copy): each run adds only its adapters, their
optimizer state and its activations. The swapped parameters are left out of
FSDP (`apply_fsdp(frozen=...)`), so with several data-parallel ranks each rank
holds the whole frozen base. The base goes when its last run is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class _Base:
    params: dict[str, nn.Parameter]
    runs: set[str] = field(default_factory=set)


class SharedBases:
    def __init__(self) -> None:
        self._bases: dict[tuple, _Base] = {}

    def for_run(self, key: tuple, run_id: str) -> BaseShare:
        """What a backend of `run_id` on base `key` (model folder, dtype, device, layout) shares through."""
        return BaseShare(self, key, run_id)

    def share(self, key: tuple, run_id: str, module: nn.Module) -> int:
        """Swap `module`'s frozen parameters for those of `key`'s base (recording them when it is the first
        run); returns the bytes the run did not allocate again."""
        base = self._bases.setdefault(key, _Base({}))
        base.runs.add(run_id)
        saved = 0
        for name, param in list(module.named_parameters()):
            if param.requires_grad:
                continue
            # An adapted layer's weight is its `base_layer`'s (peft), whatever other runs adapt, and a layer's
            # weights are the same whether this run checkpoints it or not (activation_checkpointing_fraction).
            canonical = name.replace(".base_layer.", ".").replace("._checkpoint_wrapped_module", "")
            held = base.params.get(canonical)
            if held is None:
                base.params[canonical] = param
            elif held is not param and (type(held), held.shape, held.dtype, held.device) == (
                    type(param), param.shape, param.dtype, param.device):
                parent, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, leaf, held)
                saved += param.numel() * param.element_size()
        return saved

    def release(self, run_id: str) -> None:
        for key, base in list(self._bases.items()):
            base.runs.discard(run_id)
            if not base.runs:
                del self._bases[key]

    def runs(self, key: tuple) -> set[str]:
        base = self._bases.get(key)
        return set(base.runs) if base else set()


@dataclass(frozen=True)
class BaseShare:
    """One run's handle on a shared base (a backend calls `share` once its model is parallelised)."""

    bases: SharedBases
    key: tuple
    run_id: str

    def share(self, module: nn.Module) -> int:
        return self.bases.share(self.key, self.run_id, module)
