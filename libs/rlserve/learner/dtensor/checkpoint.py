"""Checkpoints of the dtensor backend: torch distributed checkpoint plus rlserve's extra state.

Layout of a checkpoint folder:
- `dcp/`: model and optimizer state dicts (`get_state_dict`), sharded as the
  ranks hold them; DCP reshards on load.
- `rng_rank{r}.pt`: each rank's CPU generator.
- `extra.pt` (rank 0): version and lr schedule, which the learner app checks for.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    torch.save({"rng": torch.get_rng_state()}, path / f"rng_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        torch.save(extra, path / "extra.pt")
    dist.barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer and RNG in place; returns the extra state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = path / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=True)["rng"])
    return torch.load(path / "extra.pt", weights_only=True)
