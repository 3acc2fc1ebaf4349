"""The dtensor backend's part of a checkpoint (layout: `rlserve.learner.checkpoint`).

`dcp/`: model and optimizer state dicts (`get_state_dict`), sharded as the
ranks hold them; torch distributed checkpoint reshards on load. With LoRA the
frozen base is left out (`ignore_frozen_params`): a checkpoint holds the
adapters and their optimizer state, and the base comes from the model folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# Frozen parameters (a LoRA run's base) are not trained state: they come from the model folder.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore model and optimizer in place."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
