"""The sampling parameters the coordinator sends: every EOS id of the model stops generation."""

from __future__ import annotations

from rlserve.config import RunSpec
from services.coordinator.rollouts import sampling_params


def test_every_eos_id_stops_generation_beside_the_specs_stop_ids():
    spec = RunSpec.model_validate({"policy": {"generation": {"stop_token_ids": [7, 4], "temperature": 0.7}}})
    params = sampling_params(spec, greedy=False, seed=3, eos_ids=[4, 2])
    assert list(params.stop_token_ids) == [7, 4, 2] and params.seed == 3
    assert abs(params.temperature - 0.7) < 1e-6 and sampling_params(spec, True, None, [4]).temperature == 0.0
