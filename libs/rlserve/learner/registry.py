"""Learner backends by name: `policy.<name>_cfg.enabled` picks one.

The catalog's entries (`rlserve.catalog.LEARNER_BACKENDS`) say where the
backend's class and its model check live; both are imported on use, so the run
spec, which takes its backend names from the catalog, validates without
importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlserve.catalog import LEARNER_BACKENDS
from rlserve.registry import import_object

if TYPE_CHECKING:
    import torch

    from rlserve.config.spec import RunSpec
    from rlserve.learner.interfaces import LearnerBackend
    from rlserve.learner.shared_base import BaseShare


class UnsupportedModel(ValueError):
    """The chosen backend cannot train this model as configured; `field` names the spec key to change."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def check_model(spec: RunSpec, hf_config: Any) -> None:
    """Refuse, before anything starts, a model the spec's learner backend cannot train (UnsupportedModel)."""
    import_object(LEARNER_BACKENDS[spec.policy.backend].check_model)(spec, hf_config)


def make_backend(spec: RunSpec, model_path: Path, device: torch.device,
                 init_adapter: Path | None = None, shared: BaseShare | None = None) -> LearnerBackend:
    """The spec's backend on `model_path`; with LoRA, its adapters start from `init_adapter` when given
    (a PEFT folder, e.g. the run's SFT warm start), else fresh (B = 0). `shared`: the frozen base is
    held once with other runs' (`rlserve.learner.shared_base`; the dtensor backend, else ignored)."""
    from transformers import AutoConfig

    entry = LEARNER_BACKENDS[spec.policy.backend]
    check_model(spec, AutoConfig.from_pretrained(model_path))
    cls = import_object(entry.backend)
    if shared is not None and getattr(cls, "shares_base", False):
        return cls(spec, model_path, device, init_adapter, shared)
    return cls(spec, model_path, device, init_adapter)
