"""The one place learner backends are chosen by name (`policy.dtensor_cfg` / `policy.megatron_cfg`)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlserve.config.spec import RunSpec
from rlserve.learner.interfaces import LearnerBackend


def _dtensor(spec: RunSpec, model_path: Path, device: torch.device) -> LearnerBackend:
    from rlserve.learner.dtensor.backend import DTensorBackend

    return DTensorBackend(spec, model_path, device)


def _megatron(spec: RunSpec, model_path: Path, device: torch.device) -> LearnerBackend:
    from rlserve.learner.megatron.backend import MegatronBackend

    return MegatronBackend(spec, model_path, device)


BACKENDS = {"dtensor": _dtensor, "megatron": _megatron}


def make_backend(spec: RunSpec, model_path: Path, device: torch.device) -> LearnerBackend:
    name = spec.policy.backend
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown learner backend {name!r}; valid backends: {', '.join(BACKENDS)}") from None
    return factory(spec, model_path, device)
