"""The dtensor backend's part of a checkpoint (layout: `rlserve.learner.checkpoint`).

`dcp/`: model and optimizer state dicts (`get_state_dict`), sharded as the
ranks hold them; torch distributed checkpoint reshards on load.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore model and optimizer in place."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
