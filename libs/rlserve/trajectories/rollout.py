"""The one trajectory producer: examples in, scored groups of trajectories out.

Every sample is an episode. Without an environment it is an episode of one turn: the whole request's
prompts generate in one `Generate` call and their completions are scored in one batch `Score`
(`single_turn.py`). With one (`env.enabled`), each episode is its own task of several turns, each
ended by the environment's `Step` (`episodes.py`). Either way the result is the same `Group`s of
`Trajectory`s, which the trainer, validation and the checkpoints read alike; then, when the KL term
or a teacher needs them, the reference service's logprobs of every trajectory. An `external_agent`
run's episodes are played by agent programs through the endpoint (`external.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.trajectories import episodes, external, single_turn
from rlserve.trajectories.generation import Played, Plays
from rlserve.trajectories.timings import BatchTimings
from rlserve.trajectories.trajectory import Group
from rlserve.v1 import reference_pb2


async def play(services: RunServices, inputs: RunInputs, plays: Plays, reference_model: Path | None) -> Played:
    """Play and score `plays`; with `reference_model`, add the reference logprobs the spec needs."""
    env = inputs.spec.env
    player = external.play if env.external_agent else episodes.play if env.enabled else single_turn.play
    played = await player(services, inputs, plays)
    if reference_model is not None and inputs.spec.reference_from_service:
        await add_reference_logprobs(services, [g for g in played.groups if not g.env_failures], reference_model,
                                     played.timings)
    return played


async def add_reference_logprobs(services: RunServices, groups: list[Group], reference_model: Path,
                                 timings: BatchTimings) -> None:
    """The reference policy's logprobs of every trajectory token of `groups` (each sequence of a trajectory
    after its own prompt)."""
    if not groups:
        return
    t0 = time.perf_counter()
    ref = await services.reference_logprobs(reference_pb2.LogProbsRequest(
        model_path=str(reference_model), sequences=[
            reference_pb2.ScoredSequence(token_ids=prompt + t.tokens[start:end], prompt_length=len(prompt))
            for g in groups for t in g.trajectories for prompt, start, end in t.sequences(g.prompt_ids)]))
    timings.reference_s += time.perf_counter() - t0
    timings.reference_compute_s += ref.compute_seconds
    scored = iter(ref.sequences)
    for g in groups:
        for t in g.trajectories:
            t.ref_logprobs = [lp for _ in t.sequences(g.prompt_ids) for lp in next(scored).logprobs]
