"""DAPO's overlong reward shaping against the paper's piecewise formula (arXiv:2503.14476, eq. 13)."""

from __future__ import annotations

import pytest
import torch

from rlserve.algorithms.reward_shaping import overlong_penalty
from rlserve.config import SpecError, parse_spec


def paper(length: int, l_max: int, l_cache: int) -> float:
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_matches_the_paper(penalty):
    lengths = torch.tensor([[1, 15, 16, 17], [19, 20, 21, 40]])
    got = overlong_penalty(lengths, max_response_length=20, buffer_length=5, penalty=penalty)
    expected = [[penalty * paper(n, 20, 5) for n in row] for row in lengths.tolist()]
    assert got.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


@pytest.mark.parametrize("data, field", [
    ({"grpo": {"reward_shaping": {"enabled": True}}}, "grpo.reward_shaping.overlong_buffer_length"),
    ({"grpo": {"reward_shaping": {"enabled": True, "overlong_buffer_length": 17}}},  # max_new_tokens is 16
     "grpo.reward_shaping.overlong_buffer_length"),
    ({"grpo": {"reward_shaping": {"overlong_buffer_penalty": -1}}}, "grpo.reward_shaping.overlong_buffer_penalty"),
    ({"grpo": {"reward_shaping": {"max_response_length": 0}}}, "grpo.reward_shaping.max_response_length"),
])
def test_bad_shaping_keys_name_the_field(data, field):
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert err.value.problems[0].startswith(field + ":"), err.value.problems


def test_the_cap_defaults_to_max_new_tokens():
    spec = parse_spec({"grpo": {"reward_shaping": {"enabled": True, "overlong_buffer_length": 4}},
                       "policy": {"generation": {"max_new_tokens": 12}}})
    assert spec.max_response_length == 12
