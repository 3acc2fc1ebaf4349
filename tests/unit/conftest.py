"""A run record and its inputs for unit tests of the loop and the trajectories (the generated tiny model, a
small data set)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rlserve.config import RunSpec, spec_to_yaml
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.inputs import RunInputs
from rlserve.runs.record import Run

SMALL = {"data": {"num_train": 200, "num_val": 8}, "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4,
                                                          "max_num_steps": 4, "max_val_samples": 8, "val_period": 2},
         "policy": {"generation": {"max_new_tokens": 4}, "max_total_sequence_length": 32},
         "logger": {"tensorboard_enabled": False, "plot_enabled": False}, "checkpointing": {"save_period": 2}}


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


@pytest.fixture
def make_run(tmp_path) -> Callable[..., tuple[Run, RunInputs]]:
    """`make_run(run_id, **spec overrides)` -> a QUEUED run record in tmp_path and its inputs."""
    def make(run_id: str = "r", **over) -> tuple[Run, RunInputs]:
        spec = RunSpec.model_validate(merged(SMALL, over))
        run_dir = tmp_path / run_id
        run_dir.mkdir()
        (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        return Run(run_id, spec, run_dir), RunInputs.build(run_id, spec, run_dir, algorithm_class(spec).data)
    return make
