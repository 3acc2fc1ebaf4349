"""Every example spec and cluster file in examples/ passes validation as shipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlserve.cluster.config import load_cluster_file
from rlserve.config import load_spec

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("path", sorted([*EXAMPLES.glob("grpo_*.yaml"), *EXAMPLES.glob("sft_*.yaml"),
                                          *EXAMPLES.glob("dpo_*.yaml"),
                                          *EXAMPLES.glob("distillation_*.yaml")]), ids=lambda p: p.name)
def test_example_specs_validate(path):
    spec = load_spec(path)
    assert spec.max_num_steps > 0 and path.name.startswith(spec.algorithm)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("cluster_*.yaml")), ids=lambda p: p.name)
def test_example_cluster_files_load(path):
    cfg, _ = load_cluster_file(path)
    assert cfg.loopback
