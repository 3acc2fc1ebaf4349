"""Multi-turn episodes: per sample, generate -> environment step -> append the observation -> generate
again, until the environment says done, `grpo.max_rollout_turns`, or the token budget
(`policy.max_total_sequence_length`) ends it. Each episode records how it ended: `done`, `max_turns`
or `truncated` (a turn cut by the token limits, or an observation that no longer fits).

Token-exact: an episode's tokens are the prompt (the environment's first messages through the chat
template), then each turn's tokens exactly as the engine generated them, each followed by the
observation's tokens, rendered from the new messages only (`PromptTokenizer.observation_ids`).
Nothing is re-tokenized from text, so the learner scores exactly the tokens that were sampled. The
loss mask is 1 on the policy's tokens and 0 on the observations and the template's turn markers;
their generator logprobs are 0 (never read).

A group is the `num_generations_per_prompt` episodes of one prompt: the environment's `Reset` runs
once per prompt and every episode of the group starts from its messages and state. Every episode is
its own asyncio task, so while one waits for its environment the engine keeps generating the others'
turns (at most `env.max_concurrent_episodes` of one request at once). Each turn's tokens carry the
weight versions that produced them, so in-flight updates across turns are recorded token by token.

An environment that fails (its plug-in raised or returned something malformed, a call took longer
than `env.timeout_s`, its messages break the template) ends that episode with a failure; its group is
dropped by the trainer (`env_error`, `env_timeout`) and counted in the ledger, and the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from jinja2 import TemplateError

from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.environments.serving import (
    MAX_STATE_CHARS,
    MAX_TOOLS_CHARS,
    ContractError,
    checked_messages,
    messages_from_proto,
    messages_to_proto,
    tools_json,
)
from rlserve.grpo.groups import Group, per_sample_means
from rlserve.grpo.rollouts import BatchTimings, add_reference_logprobs, record_generate, sampling_params
from rlserve.grpo.services import RunServices
from rlserve.grpo.state import RunInputs
from rlserve.v1 import common_pb2, environment_pb2, rollout_pb2

T = TypeVar("T")
ENDINGS = ("done", "max_turns", "truncated")
Message = dict[str, str]


class EpisodeFailed(Exception):
    """The environment failed this episode; `reason` is the ledger's drop reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message[:300]


@dataclass
class Trajectory:
    """One episode after its prompt."""

    tokens: list[int] = field(default_factory=list)  # the policy's turns, observations and markers
    logprobs: list[float] = field(default_factory=list)  # the generator's, per token (0 for context)
    mask: list[bool] = field(default_factory=list)  # the loss counts the token (the policy's own)
    versions: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end) in tokens
    reward: float = 0.0
    turns: int = 0
    ending: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    failure: tuple[str, str] | None = None  # (drop reason, message)

    def add(self, ids: list[int], logprobs: list[float] | None, runs=()) -> None:
        start = len(self.tokens)
        self.tokens += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [logprobs is not None] * len(ids)
        self.versions += [(r.version, start + r.start, start + r.end) for r in runs]


def episode_proto(tok: PromptTokenizer, ex: Example, episode_id: str) -> environment_pb2.Episode:
    """The data row as the environment sees it (its first messages as the chat template would render them)."""
    messages = tok.messages(ex) if tok.prompt_format == "chat" else [{"role": "user", "content": ex.prompt}]
    return environment_pb2.Episode(id=episode_id, prompt=ex.prompt, messages=messages_to_proto(messages),
                                   reference_answer=ex.answer, metadata_json=json.dumps(ex.metadata),
                                   env_args_json=json.dumps(ex.env_args))


def _checked(messages, what: str) -> list[Message]:
    try:
        return checked_messages(messages_from_proto(messages), what)
    except ContractError as err:
        raise EpisodeFailed("env_error", f"the environment's {err}") from None


def _status(resp, call: str) -> None:
    if resp.status == environment_pb2.ENVIRONMENT_STATUS_ERROR:
        raise EpisodeFailed("env_error", resp.error or f"the environment's {call} failed without a message")
    if resp.status != environment_pb2.ENVIRONMENT_STATUS_OK:
        raise EpisodeFailed("env_error", f"the environment's {call} answered status {resp.status}")
    if len(resp.state_json) > MAX_STATE_CHARS:
        raise EpisodeFailed("env_error", f"the environment's {call} returned {len(resp.state_json)} characters of "
                                         f"state, at most {MAX_STATE_CHARS}")


def _tools(resp) -> list[dict] | None:
    """Reset's tools for the chat template (checked as the environment service checks its own)."""
    if not resp.tools_json:
        return None
    try:
        if len(resp.tools_json) > MAX_TOOLS_CHARS:
            raise ContractError(f"tools: {len(resp.tools_json)} characters of JSON, at most {MAX_TOOLS_CHARS}")
        tools = json.loads(resp.tools_json)
        tools_json(tools)
    except (ContractError, ValueError) as err:
        raise EpisodeFailed("env_error", f"the environment's Reset tools: {err}") from None
    return tools


class EpisodeRunner:
    """Plays episodes for one generation request (a step, a streaming request, or validation)."""

    def __init__(self, services: RunServices, inputs: RunInputs, timings: BatchTimings, min_version: int,
                 greedy: bool):
        self.services, self.inputs, self.timings = services, inputs, timings
        self.spec, self.tok = inputs.spec, inputs.tok
        self.min_version, self.greedy = min_version, greedy
        self.environment = self.spec.env.environment(self.spec.reward.functions).to_proto()
        self.limit = asyncio.Semaphore(self.spec.env.max_concurrent_episodes)
        self.env_version = ""

    async def _env_call(self, call: str, make: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(make, self.spec.env.timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeFailed("env_timeout", f"the environment's {call} took more than env.timeout_s "
                                               f"({self.spec.env.timeout_s:g}s)") from None
        finally:
            self.timings.env_s += time.perf_counter() - t0

    async def reset(self, ex: Example, episode_id: str
                    ) -> tuple[environment_pb2.Episode, list[Message], str, list[dict] | None]:
        """The group's start: the environment's first messages, state and the tools it declares."""
        episode = episode_proto(self.tok, ex, episode_id)
        resp = await self._env_call("Reset", self.services.env_reset(environment_pb2.ResetRequest(
            environment=self.environment, episode=episode, run_id=self.inputs.run_id)))
        _status(resp, "Reset")
        self.env_version = resp.environment_version or self.env_version
        messages = _checked(resp.messages, "Reset messages")
        if not messages:
            raise EpisodeFailed("env_error", "the environment's Reset returned no message")
        return episode, messages, resp.state_json, _tools(resp)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        try:
            ids = self.tok.episode_prompt_ids(messages, tools)
        except (TemplateError, ValueError) as err:
            raise EpisodeFailed("env_error", f"the chat template cannot render the first messages: {err}") from None
        if len(ids) >= self.spec.policy.max_total_sequence_length:
            raise EpisodeFailed("env_error", f"the first messages take {len(ids)} tokens, "
                                             f"policy.max_total_sequence_length is "
                                             f"{self.spec.policy.max_total_sequence_length}")
        return ids

    async def _generate(self, tokens: list[int], room: int, seed: int) -> rollout_pb2.Sample:
        params = sampling_params(self.spec, self.greedy, seed, self.tok.eos_ids)
        params.max_new_tokens = min(params.max_new_tokens, room)
        req = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=tokens))],
                                          num_samples=1, sampling=params, min_weight_version=self.min_version,
                                          run_id=self.inputs.run_id, shared_base=self.spec.shares_deployed_base,
                                          priority=self.spec.priority)
        t0 = time.perf_counter()
        resp = await self.services.generate(req)
        record_generate(resp, time.perf_counter() - t0, self.timings)
        return resp.completions[0].samples[0]

    async def play(self, episode: environment_pb2.Episode, prompt: list[int], messages: list[Message], state: str,
                   seed: int) -> Trajectory:
        """One episode from the group's start; a failing environment ends it with `failure` set."""
        async with self.limit:
            traj = Trajectory()
            try:
                await self._play(traj, episode, prompt, messages, state, seed)
            except EpisodeFailed as err:
                traj.failure = (err.reason, err.message)
            return traj

    async def _play(self, traj: Trajectory, episode: environment_pb2.Episode, prompt: list[int],
                    messages: list[Message], state: str, seed: int) -> None:
        budget = self.spec.policy.max_total_sequence_length
        conversation = list(messages)
        for turn in range(1, self.spec.grpo.max_rollout_turns + 1):
            sample = await self._generate(prompt + traj.tokens, budget - len(prompt) - len(traj.tokens),
                                          (seed * 1009 + turn) % 2**62)
            traj.add(list(sample.token_ids), list(sample.logprobs), sample.version_runs)
            traj.turns = turn
            assistant = environment_pb2.ChatMessage(role="assistant", content=sample.text)
            resp = await self._env_call("Step", self.services.env_step(environment_pb2.StepRequest(
                environment=self.environment, episode=episode, conversation=messages_to_proto(conversation),
                assistant=assistant, state_json=state, turn=turn, run_id=self.inputs.run_id)))
            _status(resp, "Step")
            if not math.isfinite(resp.reward):
                raise EpisodeFailed("env_error", f"the environment's reward is {resp.reward}")
            observation = _checked(resp.observation, "observation")
            traj.reward += resp.reward
            traj.metrics.update(resp.metrics)
            state = resp.state_json
            if resp.done:
                traj.ending = "done"
                return
            if not observation:
                raise EpisodeFailed("env_error", "the environment's Step is not done and has no observation")
            if sample.finish_reason != common_pb2.FINISH_REASON_STOP:
                traj.ending = "truncated"  # the turn was cut (max_new_tokens or the token budget)
                return
            if turn == self.spec.grpo.max_rollout_turns:
                traj.ending = "max_turns"
                return
            try:
                ids = self.tok.observation_ids(observation, sample.token_ids[-1] if sample.token_ids else -1)
            except (TemplateError, ValueError) as err:
                raise EpisodeFailed("env_error", f"the chat template cannot render the observation: {err}") from None
            if len(prompt) + len(traj.tokens) + len(ids) >= budget:
                traj.ending = "truncated"  # no room for the observation and a next turn
                return
            traj.add(ids, None)
            conversation += [{"role": "assistant", "content": sample.text}, *observation]


def _episode_seed(base: int, i: int, j: int) -> int:
    return ((base + i) * 1_000_033 + j) % 2**62


def _versions(trajs: list[Trajectory], default: int) -> tuple[int, int, int]:
    """(oldest version, episodes spanning versions, largest newest-minus-oldest) of one group."""
    oldest, mixed, spread = None, 0, 0
    for t in trajs:
        versions = [v for v, _, _ in t.versions] or [default]
        oldest = min(versions) if oldest is None else min(oldest, *versions)
        mixed += len(set(versions)) > 1
        spread = max(spread, max(versions) - min(versions))
    return (default if oldest is None else oldest), mixed, spread


async def _group(runner: EpisodeRunner, ex: Example, index: int, episode_id: str, n: int, seed_base: int,
                 offset: int) -> tuple[list[int], list[Trajectory]]:
    try:
        episode, messages, state, tools = await runner.reset(ex, episode_id)
        prompt = runner.prompt_ids(messages, tools)
    except EpisodeFailed as err:
        return [], [Trajectory(failure=(err.reason, err.message)) for _ in range(n)]
    trajs = await asyncio.gather(*(runner.play(episode, prompt, messages, state,
                                               _episode_seed(seed_base, offset + index, j)) for j in range(n)))
    return prompt, list(trajs)


async def episode_groups(services: RunServices, inputs: RunInputs, examples: list[Example], first_index: int,
                         step: int, min_version: int, reference_model: Path, offset: int = 0
                         ) -> tuple[list[Group], str, BatchTimings]:
    """The groups of step `step` played as episodes (as `rollouts.rollout_groups` for one-turn scoring):
    returns the groups, the environment's version string, and the timings."""
    spec, run_id = inputs.spec, inputs.run_id
    timings = BatchTimings()
    runner = EpisodeRunner(services, inputs, timings, min_version, greedy=False)
    n = spec.grpo.num_generations_per_prompt
    seed_base = spec.grpo.seed * 1_000_003 + step
    played = await asyncio.gather(*(
        _group(runner, ex, i, f"{run_id}/{step}/{first_index + i}", n, seed_base, offset)
        for i, ex in enumerate(examples)))
    groups = []
    for i, (prompt, trajs) in enumerate(played):
        oldest, mixed, spread = _versions(trajs, min_version)
        groups.append(Group(
            prompt_index=first_index + i, prompt_ids=prompt, completions=[t.tokens for t in trajs],
            gen_logprobs=[t.logprobs for t in trajs], rewards=[t.reward for t in trajs], weight_version=oldest,
            mixed_samples=mixed, version_spread=spread, loss_masks=[t.mask for t in trajs],
            endings=[t.ending for t in trajs], turns=[t.turns for t in trajs],
            episode_metrics=[t.metrics for t in trajs],
            env_failures=[list(t.failure) for t in trajs if t.failure is not None]))
    await add_reference_logprobs(services, inputs, [g for g in groups if not g.env_failures], reference_model,
                                 timings)
    return groups, runner.env_version, timings


def episode_metrics(groups: list[Group], prefix: str = "episode/") -> dict[str, float]:
    """How episodes ended and what their environment reported (means over the groups' episodes)."""
    endings = [e for g in groups for e in g.endings]
    if not endings:
        return {}
    out = {f"{prefix}{e}_fraction": endings.count(e) / len(endings) for e in ENDINGS}
    out[f"{prefix}turns_mean"] = sum(t for g in groups for t in g.turns) / len(endings)
    out[f"{prefix}context_tokens_mean"] = sum(
        len(m) - sum(m) for g in groups for m in (g.loss_masks or [])) / len(endings)
    return {**out, **per_sample_means([m for g in groups for m in g.episode_metrics], f"{prefix}env/")}


async def evaluate_episodes(services: RunServices, inputs: RunInputs, min_version: int
                            ) -> tuple[dict[str, float], list[str]]:
    """Held-out episodes (one per validation example, `grpo.val_greedy`): `val/reward` is the mean return
    over the episodes the environment did not fail (NaN if it failed all), with how they ended and
    the environment's metrics; and the failures' messages."""
    spec, examples = inputs.spec, list(inputs.val)
    timings = BatchTimings()
    runner = EpisodeRunner(services, inputs, timings, min_version, greedy=spec.grpo.val_greedy)
    played = await asyncio.gather(*(_group(runner, ex, i, f"{inputs.run_id}/val/{i}", 1, spec.grpo.seed, 0)
                                    for i, ex in enumerate(examples)))
    trajs = [t for _, ts in played for t in ts]
    ok = [t for t in trajs if t.failure is None]
    errors = [f"{t.failure[0]}: {t.failure[1]}" for t in trajs if t.failure is not None]
    groups = [Group(prompt_index=0, prompt_ids=[], completions=[t.tokens], gen_logprobs=[], rewards=[t.reward],
                    weight_version=0, loss_masks=[t.mask], endings=[t.ending], turns=[t.turns],
                    episode_metrics=[t.metrics]) for t in ok]
    metrics = {"val/reward": sum(t.reward for t in ok) / len(ok) if ok else math.nan,
               "val/reward_errors": float(len(errors)), "val/weight_version": float(_versions(ok, min_version)[0]),
               **episode_metrics(groups, prefix="val/episode/")}
    return metrics, errors
