"""What the loop asks the rollout for, and what it reads back: every EOS id stops generation; a sample's
age is that of its oldest version."""

from __future__ import annotations

from rlserve.config import RunSpec
from rlserve.grpo.rollouts import sample_versions, sampling_params
from rlserve.v1 import rollout_pb2


def test_every_eos_id_stops_generation_beside_the_specs_stop_ids():
    spec = RunSpec.model_validate({"policy": {"generation": {"stop_token_ids": [7, 4], "temperature": 0.7}}})
    params = sampling_params(spec, greedy=False, seed=3, eos_ids=[4, 2])
    assert list(params.stop_token_ids) == [7, 4, 2] and params.seed == 3
    assert abs(params.temperature - 0.7) < 1e-6 and sampling_params(spec, True, None, [4]).temperature == 0.0


def test_a_samples_age_is_that_of_its_oldest_version():
    run = rollout_pb2.VersionRun
    completion = rollout_pb2.Completion(samples=[
        rollout_pb2.Sample(token_ids=[1, 2, 3], version_runs=[run(version=4, start=0, end=2),
                                                              run(version=5, start=2, end=3)]),
        rollout_pb2.Sample(token_ids=[1], version_runs=[run(version=5, start=0, end=1)])])
    assert sample_versions(completion, default=9) == (4, 1, 1)
    assert sample_versions(rollout_pb2.Completion(samples=[rollout_pb2.Sample(token_ids=[1])]), default=9) == (9, 0, 0)
