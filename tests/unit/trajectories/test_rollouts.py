"""What the producer asks the rollout for, and what it reads back: every EOS id stops generation; a group's
age is that of its trajectories' oldest version; a one-turn sample is an episode of one turn."""

from __future__ import annotations

import asyncio

from rlserve.trajectories.generation import Plays, sampling_params
from rlserve.trajectories.rollout import play
from rlserve.trajectories.trajectory import Group, Trajectory
from rlserve.v1 import rollout_pb2
from tests.support.fake_services import FakeServices


def test_every_eos_id_stops_generation_beside_the_specs_stop_ids(make_run):
    _, inputs = make_run(policy={"generation": {"stop_token_ids": [7, 4], "temperature": 0.7, "max_new_tokens": 4}})
    eos = inputs.tok.eos_ids
    params = sampling_params(inputs, greedy=False, seed=3)
    assert list(params.stop_token_ids) == list(dict.fromkeys([7, 4, *eos])) and params.seed == 3
    assert abs(params.temperature - 0.7) < 1e-6 and sampling_params(inputs, True, None).temperature == 0.0


def test_a_groups_age_is_that_of_its_oldest_version():
    run = rollout_pb2.VersionRun
    spanning, newer = Trajectory(), Trajectory()
    spanning.add([1, 2, 3], [-1.0] * 3, [run(version=4, start=0, end=2), run(version=5, start=2, end=3)])
    newer.add([1], [-1.0], [run(version=5, start=0, end=1)])
    group = Group.of(0, [9], [spanning, newer], default=9)
    assert (group.weight_version, group.mixed_samples, group.version_spread) == (4, 1, 1)
    unversioned = Trajectory()
    unversioned.add([1], [-1.0])
    assert Group.of(0, [9], [unversioned], default=9).weight_version == 9


def test_a_single_turn_sample_is_an_episode_of_one_turn_scored_in_a_batch(make_run):
    _, inputs = make_run()
    services = FakeServices()
    examples = list(inputs.train[:3])
    played = asyncio.run(play(services, inputs, Plays(examples, 5, "0", 42, 0, 4, False, 0), None))
    assert len(services.calls.generate) == 1 and services.calls.generate[0].num_samples == 4
    assert [g.prompt_index for g in played.groups] == [5, 6, 7] and played.version == "fake-reward"
    for g in played.groups:
        assert g.size == 4 and all(t.turns == 1 and t.ending == "done" and all(t.mask) for t in g.trajectories)
        assert g.generated_tokens == sum(len(t.tokens) for t in g.trajectories)
