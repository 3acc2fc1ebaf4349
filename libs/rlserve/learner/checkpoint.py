"""Learner checkpoints: the folder layout every backend shares.

`LearnerBackend.save_checkpoint` / `load_checkpoint` write and read it; a
backend supplies only its model and optimizer state and any random state of
its own. A checkpoint folder holds:

- the backend's model and optimizer state in a sub-folder of its own (`dcp/`:
  torch distributed checkpoint, dtensor; `megatron/`: Megatron's
  dist_checkpointing, megatron; see their `checkpoint` modules);
- `rng_rank{r}.pt`: each rank's random generators (CPU, CUDA, and what the
  backend adds);
- `extra.pt` (rank 0): version and lr schedule. Its presence marks a folder
  as a learner checkpoint (`is_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

EXTRA_FILE = "extra.pt"


def is_checkpoint(path: Path) -> bool:
    return (path / EXTRA_FILE).is_file()


def rng_file(path: Path) -> Path:
    """This rank's random state file in checkpoint folder `path`."""
    return path / f"rng_rank{dist.get_rank()}.pt"


def rng_state() -> dict:
    """torch's CPU generator, and the current CUDA device's when there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    # Checkpoints of the dtensor backend written before the layout was shared name the CPU state "rng".
    torch.set_rng_state(state["cpu"] if "cpu" in state else state["rng"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
