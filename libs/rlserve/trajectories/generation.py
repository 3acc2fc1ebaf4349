"""What every rollout request is made of: the plays it asks for, the sampling, the `Generate` call.

Seeds: prompt i of a request at `offset` within its step samples with `seed_base + offset + i` (the
engine seeds prompt i with the request's seed + i), so a step split into several requests
(streaming) samples exactly what one request would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlserve.data.tasks import Example
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.trajectories.timings import BatchTimings
from rlserve.trajectories.trajectory import Group
from rlserve.v1 import common_pb2, rollout_pb2


@dataclass(frozen=True)
class Plays:
    """What one rollout request plays: `n` trajectories of each example."""

    examples: list[Example]
    first_index: int  # the data cursor at examples[0]
    label: str  # names the trajectories in services' logs: the step number, or "val"
    seed_base: int
    offset: int  # examples[0]'s position within its step
    n: int
    greedy: bool
    min_version: int  # the weight version the engines must serve at least


@dataclass
class Played:
    groups: list[Group]
    version: str  # the reward service's (or the environment's) version string
    timings: BatchTimings = field(default_factory=BatchTimings)


def sampling_params(inputs: RunInputs, greedy: bool, seed: int | None) -> common_pb2.SamplingParams:
    """The spec's sampling; every EOS id of the model stops, whatever the engine takes as its EOS."""
    gen = inputs.spec.policy.generation
    stop_ids = list(dict.fromkeys([*gen.stop_token_ids, *inputs.tok.eos_ids]))
    params = common_pb2.SamplingParams(
        temperature=0.0 if greedy else gen.temperature, top_p=gen.top_p, top_k=gen.top_k or 0,
        max_new_tokens=gen.max_new_tokens, stop_strings=gen.stop_strings, stop_token_ids=stop_ids)
    if seed is not None:
        params.seed = seed
    return params


async def generate(services: RunServices, inputs: RunInputs, prompts: list[list[int]], n: int,
                   params: common_pb2.SamplingParams, min_version: int,
                   timings: BatchTimings) -> rollout_pb2.GenerateResponse:
    """One Generate call for the run (its adapter, its priority), timed into `timings`."""
    spec = inputs.spec
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=p)) for p in prompts], num_samples=n,
        sampling=params, min_weight_version=min_version, run_id=inputs.run_id,
        shared_base=spec.shares_deployed_base, priority=spec.priority, routed_experts=spec.policy.routing_replay)
    t0 = time.perf_counter()
    resp = await services.generate(req)
    timings.record_generate(resp, time.perf_counter() - t0)
    return resp
