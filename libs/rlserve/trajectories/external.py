"""Episodes an agent program plays through the endpoint (`env.name: external_agent`, `rlserve.agents`).

The producer and validation play them like any episodes (`rollout.play`): each example of the request
is offered as `n` episodes sharing its task id (a group), which agents take from `GET /v1/episodes/next`,
play with OpenAI-style calls, and end with a reward (`POST /v1/episodes/{id}/reward`); an episode not
ended within `env.timeout_s` of being handed out is abandoned and fails its group. With
`env.args.tasks: agent` the agents bring their own tasks instead: a request takes the next groups of
`n` ended episodes of one task id, in the order they complete.

Everything downstream is as for built-in environments: each trajectory's tokens and logprobs are the
engine's (`agents.session`), tagged with the weight versions that sampled them, so the staleness bound,
in-flight updates and the importance-sampling correction apply token by token; the groups are counted in
the ledger when the step is committed; the calls' generate seconds and the engines' activity are the
step's timing and usage metrics.
"""

from __future__ import annotations

import asyncio

from rlserve.agents.session import Episode, session_for
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.trajectories.generation import Played, Plays
from rlserve.trajectories.timings import BatchTimings
from rlserve.trajectories.trajectory import Group

# The version string of what scored these episodes (agents, or the reward functions through them).
VERSION = "external_agent"


async def play(services: RunServices, inputs: RunInputs, plays: Plays) -> Played:
    """Offer `plays` to the run's agents and wait until every episode ended (or was abandoned)."""
    session = session_for(services, inputs)
    validation = plays.label == "val"
    if session.args.tasks == "agent" and not validation:
        ready, timings = await session.own_groups(len(plays.examples))
    else:
        timings = BatchTimings()
        ready = [[session.offer(ex, f"{inputs.run_id}/{plays.label}/{plays.first_index + i}", validation, plays.greedy,
                                plays.min_version, timings) for _ in range(plays.n)]
                 for i, ex in enumerate(plays.examples)]
    try:
        played = [await asyncio.gather(*(ep.done for ep in group)) for group in ready]
    except asyncio.CancelledError:
        session.withdraw([ep for group in ready for ep in group])
        raise
    groups = [Group.of(plays.first_index + i, [], list(trajectories), _oldest(ready[i], plays.min_version))
              for i, trajectories in enumerate(played)]
    return Played(groups, VERSION, timings)


def _oldest(episodes: list[Episode], default: int) -> int:
    return min((ep.min_version for ep in episodes), default=default)
