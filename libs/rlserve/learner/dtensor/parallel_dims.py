"""The one place that owns the DTensor backend's parallel layout (after torchtitan's ParallelDims)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.dp * self.tp != self.world_size:
            raise ValueError(f"dp ({self.dp}) * tp ({self.tp}) must equal the world size ({self.world_size})")

    @classmethod
    def from_world(cls, world_size: int, tp: int) -> ParallelDims:
        if world_size % tp:
            raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size ({tp}) must divide the learner world "
                             f"size ({world_size})")
        return cls(dp=world_size // tp, tp=tp, world_size=world_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D mesh: data parallel outer, tensor parallel inner (TP peers are neighbours)."""
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))

    def describe(self) -> str:
        return f"dp={self.dp} tp={self.tp}"
