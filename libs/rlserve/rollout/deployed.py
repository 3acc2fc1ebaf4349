"""A run's `policy.generation` against the rollout engine the cluster deployed.

The engine is started with the cluster (the rollout service's deploy
arguments), not per run, so the spec cannot choose it: it may only state what
it expects. Unset keys take the deployed values (so the run directory's
spec.yaml records what generated its samples); a key that disagrees is a
problem the caller refuses the run with. The rollout knows the spec only by
these key paths: it does not import the run spec's schema (`rlserve.config`).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from rlserve.v1 import rollout_pb2

# A run spec (`rlserve.config.RunSpec`): a model with the key paths `deployed_generation` names.
Spec = TypeVar("Spec", bound=BaseModel)


def deployed_generation(info: rollout_pb2.GetInfoResponse) -> dict[str, object]:
    """policy.generation key path -> the deployed engine's value."""
    return {
        "policy.generation.backend": info.engine,
        "policy.generation.vllm_cfg.precision": info.dtype,
        "policy.generation.vllm_cfg.max_model_len": info.max_model_len,
        "policy.generation.vllm_cfg.tensor_parallel_size": info.tensor_parallel_size,
        "policy.generation.vllm_cfg.gpu_memory_utilization": info.gpu_memory_utilization,
        "policy.generation.vllm_cfg.enforce_eager": info.enforce_eager,
    }


def match_generation(spec: Spec, info: rollout_pb2.GetInfoResponse) -> tuple[Spec, list[str]]:
    """(the spec with unset generation keys filled in from the deployment, the disagreements)."""
    spec = spec.model_copy(deep=True)
    problems = []
    for path, deployed in deployed_generation(info).items():
        *parents, key = path.split(".")
        section = spec
        for name in parents:
            section = getattr(section, name)
        asked = getattr(section, key)
        if asked is None:
            setattr(section, key, deployed)
        elif asked != deployed:
            problems.append(f"{path}: the run asks for {asked!r} but the rollout service runs {deployed!r} "
                            f"(set by the rollout's args in the cluster file; leave the key unset to use it)")
    return spec, problems
