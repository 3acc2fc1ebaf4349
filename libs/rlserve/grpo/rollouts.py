"""Turn prompts into scored groups: generate -> score -> reference logprobs.

One group is the `num_generations_per_prompt` samples of one prompt, tagged
with the oldest weight version that generated them. Timings separate each
service's own compute from the call's wall time (the rest is plumbing: RPC,
serialization, the object store).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlserve.config.spec import RunSpec
from rlserve.data.tasks import Example
from rlserve.grpo.groups import Group
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import Activity, RunInputs
from rlserve.v1 import common_pb2, reference_pb2, reward_pb2, rollout_pb2


@dataclass
class BatchTimings:
    generate_s: float = 0.0
    generate_engine_s: float = 0.0
    score_s: float = 0.0
    score_compute_s: float = 0.0
    reference_s: float = 0.0
    reference_compute_s: float = 0.0
    env_s: float = 0.0  # environment calls (Reset, Step) of multi-turn episodes
    # The newest activity each rollout replica reported.
    activity: Activity = field(default_factory=dict)

    def add(self, other: BatchTimings) -> None:
        """Fold in another call's timings (streaming: one per request; the sums are call seconds)."""
        for name in ("generate_s", "generate_engine_s", "score_s", "score_compute_s", "reference_s",
                     "reference_compute_s", "env_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for replica, seen in other.activity.items():
            if seen[0] >= self.activity.get(replica, (-1.0, 0.0, 0.0))[0]:
                self.activity[replica] = seen

    def metrics(self) -> dict[str, float]:
        return {
            **({"timing/env_s": self.env_s} if self.env_s else {}),
            "timing/generate_s": self.generate_s, "timing/reward_s": self.score_s,
            "timing/reference_s": self.reference_s,
            "plumbing/generate_s": self.generate_s - self.generate_engine_s,
            "plumbing/reward_s": self.score_s - self.score_compute_s,
            "plumbing/reference_s": self.reference_s - self.reference_compute_s,
        }


def sampling_params(spec: RunSpec, greedy: bool, seed: int | None, eos_ids: list[int]) -> common_pb2.SamplingParams:
    """The spec's sampling; every EOS id of the model stops, whatever the engine takes as its EOS."""
    gen = spec.policy.generation
    stop_ids = list(dict.fromkeys([*gen.stop_token_ids, *eos_ids]))
    params = common_pb2.SamplingParams(
        temperature=0.0 if greedy else gen.temperature, top_p=gen.top_p, top_k=gen.top_k or 0,
        max_new_tokens=gen.max_new_tokens, stop_strings=gen.stop_strings, stop_token_ids=stop_ids)
    if seed is not None:
        params.seed = seed
    return params


async def generate(services: RunServices, inputs: RunInputs, prompts: list[list[int]], n: int, greedy: bool,
                   seed: int | None, min_version: int, timings: BatchTimings) -> rollout_pb2.GenerateResponse:
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=p)) for p in prompts], num_samples=n,
        sampling=sampling_params(inputs.spec, greedy, seed, inputs.tok.eos_ids), min_weight_version=min_version,
        run_id=inputs.run_id, shared_base=inputs.spec.shares_deployed_base, priority=inputs.spec.priority)
    t0 = time.perf_counter()
    resp = await services.generate(req)
    record_generate(resp, time.perf_counter() - t0, timings)
    return resp


def record_generate(resp: rollout_pb2.GenerateResponse, seconds: float, timings: BatchTimings) -> None:
    """A Generate call's seconds, the engine's share of them, and the replica's activity."""
    timings.generate_s += seconds
    timings.generate_engine_s += resp.engine_seconds
    if resp.replica_id:
        timings.activity[resp.replica_id] = (resp.activity.uptime_s, resp.activity.idle_s, resp.activity.paused_s,
                                             float(resp.activity.generated_tokens))


def sample_versions(completion: rollout_pb2.Completion, default: int) -> tuple[int, int, int]:
    """(oldest version, samples spanning versions, largest newest-minus-oldest) of one prompt's samples."""
    oldest, mixed, spread = None, 0, 0
    for s in completion.samples:
        versions = [r.version for r in s.version_runs] or [default]
        oldest = min(versions) if oldest is None else min(oldest, *versions)
        mixed += len(set(versions)) > 1
        spread = max(spread, max(versions) - min(versions))
    return (default if oldest is None else oldest), mixed, spread


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


def score_items(examples: list[Example], texts: list[list[str]], ids: list[list[str]]) -> list[reward_pb2.ScoreItem]:
    return [reward_pb2.ScoreItem(id=i, prompt=ex.prompt, completion=t, reference_answer=ex.answer,
                                 metadata_json=json.dumps(ex.metadata))
            for ex, ts, is_ in zip(examples, texts, ids) for t, i in zip(ts, is_)]


async def rollout_groups(services: RunServices, inputs: RunInputs, examples: list[Example], first_index: int,
                         step: int, min_version: int, reference_model: Path, offset: int = 0
                         ) -> tuple[list[Group], str, BatchTimings]:
    """Generate, score and (when the KL needs it) reference-score groups of step `step`.

    `examples` start at position `offset` within the step: the engine seeds prompt i of a request
    with the request's seed + i, so one request per prompt (streaming) samples exactly as one
    request per step. Returns the groups, the reward service's version string, and the timings.
    """
    spec, run_id = inputs.spec, inputs.run_id
    timings = BatchTimings()
    n = spec.grpo.num_generations_per_prompt
    prompts = [inputs.tok.prompt_ids(ex) for ex in examples]
    gen = await generate(services, inputs, prompts, n, greedy=False, seed=spec.grpo.seed * 1_000_003 + step + offset,
                         min_version=min_version, timings=timings)
    # Trajectory ids: run/step/prompt/sample, named in the reward service's logs.
    ids = [[f"{run_id}/{step}/{first_index + i}/{j}" for j in range(n)] for i in range(len(examples))]
    texts = [[s.text for s in c.samples] for c in gen.completions]
    scored = await score(services, inputs, score_items(examples, texts, ids), timings)
    groups = []
    for i, completion in enumerate(gen.completions):
        results = scored.results[i * n:(i + 1) * n]
        oldest, mixed, spread = sample_versions(completion, gen.weight_version)
        groups.append(Group(
            prompt_index=first_index + i, prompt_ids=prompts[i],
            completions=[list(s.token_ids) for s in completion.samples],
            gen_logprobs=[list(s.logprobs) for s in completion.samples],
            rewards=[r.score for r in results], weight_version=oldest,
            reward_errors=[r.error or "the reward service gave no message" for r in results
                           if r.status == reward_pb2.SCORE_STATUS_ERROR],
            reward_metrics=[dict(r.metrics) for r in results if r.metrics],
            mixed_samples=mixed, version_spread=spread))
    await add_reference_logprobs(services, inputs, groups, reference_model, timings)
    return groups, scored.reward_version, timings


async def add_reference_logprobs(services: RunServices, inputs: RunInputs, groups: list[Group], reference_model: Path,
                                 timings: BatchTimings) -> None:
    """The reference policy's logprobs of every completion token of `groups`, when the KL term needs them
    from the reference service."""
    if not groups or not inputs.spec.reference_from_service:
        return
    t0 = time.perf_counter()
    ref = await services.reference_logprobs(reference_pb2.LogProbsRequest(
        model_path=str(reference_model), sequences=[
            reference_pb2.ScoredSequence(token_ids=g.prompt_ids + c, prompt_length=len(g.prompt_ids))
            for g in groups for c in g.completions]))
    timings.reference_s += time.perf_counter() - t0
    timings.reference_compute_s += ref.compute_seconds
    it = iter(ref.sequences)
    for g in groups:
        g.ref_logprobs = [list(next(it).logprobs) for _ in g.completions]
