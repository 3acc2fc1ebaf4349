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
    from transformers import AutoConfig

    name = spec.policy.backend
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown learner backend {name!r}; valid backends: {', '.join(BACKENDS)}") from None
    check_model(spec, AutoConfig.from_pretrained(model_path))
    return factory(spec, model_path, device)


class UnsupportedModel(ValueError):
    """The chosen backend cannot train this model as configured; `field` names the spec key to change."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def check_model(spec: RunSpec, hf_config) -> None:
    """Refuse, before anything starts, a model the spec's learner backend cannot train (UnsupportedModel).

    The reasons come from each backend's `support` module, which the backend itself also obeys.
    """
    if spec.policy.backend == "megatron":
        from rlserve.learner.megatron.support import ALTERNATIVE, unsupported_reasons

        reasons = unsupported_reasons(hf_config, spec.policy.max_total_sequence_length)
        if reasons:
            raise UnsupportedModel("policy.megatron_cfg", f"the megatron backend cannot train this "
                                   f"{hf_config.model_type} model: {'; '.join(reasons)}; {ALTERNATIVE}")
        return
    from rlserve.learner.dtensor.support import unsupported_reasons as dtensor_reasons

    reasons = dtensor_reasons(hf_config, spec.policy.dtensor_cfg)
    if reasons:
        raise UnsupportedModel("policy.dtensor_cfg.tensor_parallel_size", "; ".join(reasons))
