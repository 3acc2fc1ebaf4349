"""Episodes of one turn, scored in a batch: one `Generate` for every prompt of the request (n samples
each), then one `Score` of every completion by the run's reward functions.

A trajectory ends `done` when the engine stopped it (an EOS or stop string) and `truncated` when
`max_new_tokens` cut it. A reward plug-in that fails on a completion leaves its message on the
trajectory, and the trainer drops the group.
"""

from __future__ import annotations

import json
import time

from rlserve.data.tasks import Example
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.trajectories.generation import Played, Plays, generate, sampling_params
from rlserve.trajectories.timings import BatchTimings
from rlserve.trajectories.trajectory import Group, Trajectory
from rlserve.v1 import common_pb2, reward_pb2, rollout_pb2


def score_items(examples: list[Example], texts: list[list[str]], ids: list[list[str]]) -> list[reward_pb2.ScoreItem]:
    return [reward_pb2.ScoreItem(id=i, prompt=ex.prompt, completion=t, reference_answer=ex.answer,
                                 metadata_json=json.dumps(ex.metadata))
            for ex, ts, is_ in zip(examples, texts, ids) for t, i in zip(ts, is_)]


async def score(services: RunServices, inputs: RunInputs, items: list[reward_pb2.ScoreItem],
                timings: BatchTimings) -> reward_pb2.ScoreResponse:
    t0 = time.perf_counter()
    resp = await services.score(reward_pb2.ScoreRequest(
        items=items, functions=[f.to_proto() for f in inputs.spec.reward.functions], run_id=inputs.run_id))
    timings.score_s += time.perf_counter() - t0
    timings.score_compute_s += resp.compute_seconds
    if len(resp.results) != len(items):
        raise RuntimeError(f"reward returned {len(resp.results)} results for {len(items)} items")
    return resp


def _trajectory(sample: rollout_pb2.Sample, result: reward_pb2.ScoreResult) -> Trajectory:
    traj = Trajectory(turns=1, reward=result.score, reward_metrics=dict(result.metrics),
                      ending="done" if sample.finish_reason == common_pb2.FINISH_REASON_STOP else "truncated")
    traj.add(list(sample.token_ids), list(sample.logprobs), sample.version_runs)
    if sample.HasField("routed_experts"):
        traj.add_routes(sample.routed_experts)
    if result.status == reward_pb2.SCORE_STATUS_ERROR:
        traj.reward_error = result.error or "the reward service gave no message"
    return traj


async def play(services: RunServices, inputs: RunInputs, plays: Plays) -> Played:
    """Generate and score `plays.n` one-turn episodes of each example."""
    timings = BatchTimings()
    n = plays.n
    prompts = [inputs.tok.prompt_ids(ex) for ex in plays.examples]
    params = sampling_params(inputs, plays.greedy, plays.seed_base + plays.offset)
    gen = await generate(services, inputs, prompts, n, params, plays.min_version, timings)
    # Trajectory ids: run/step/prompt/sample, named in the reward service's logs.
    ids = [[f"{inputs.run_id}/{plays.label}/{plays.first_index + i}/{j}" for j in range(n)]
           for i in range(len(plays.examples))]
    texts = [[s.text for s in c.samples] for c in gen.completions]
    scored = await score(services, inputs, score_items(plays.examples, texts, ids), timings)
    groups = []
    for i, completion in enumerate(gen.completions):
        results = scored.results[i * n:(i + 1) * n]
        trajectories = [_trajectory(s, r) for s, r in zip(completion.samples, results)]
        groups.append(Group.of(plays.first_index + i, prompts[i], trajectories, gen.weight_version))
    return Played(groups, scored.reward_version, timings)
