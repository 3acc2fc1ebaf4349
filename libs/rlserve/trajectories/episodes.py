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
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.trajectories.generation import Played, Plays, generate, sampling_params
from rlserve.trajectories.timings import BatchTimings
from rlserve.trajectories.trajectory import Group, Trajectory
from rlserve.v1 import common_pb2, environment_pb2, rollout_pb2

T = TypeVar("T")
Message = dict[str, str]


class EpisodeFailed(Exception):
    """The environment failed this episode; `reason` is the ledger's drop reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message[:300]


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
        params = sampling_params(self.inputs, self.greedy, seed)
        params.max_new_tokens = min(params.max_new_tokens, room)
        resp = await generate(self.services, self.inputs, [tokens], 1, params, self.min_version, self.timings)
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
            if sample.HasField("routed_experts"):
                traj.add_routes(sample.routed_experts)  # this turn's positions: the context's are the earlier calls'
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
            traj.env_metrics.update(resp.metrics)
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


async def play(services: RunServices, inputs: RunInputs, plays: Plays) -> Played:
    """Play `plays.n` episodes of each example (one `Reset` per example: its episodes start alike)."""
    timings = BatchTimings()
    runner = EpisodeRunner(services, inputs, timings, plays.min_version, plays.greedy)
    started = await asyncio.gather(*(
        _group(runner, ex, i, f"{inputs.run_id}/{plays.label}/{plays.first_index + i}", plays.n, plays.seed_base,
               plays.offset) for i, ex in enumerate(plays.examples)))
    groups = [Group.of(plays.first_index + i, prompt, trajs, plays.min_version)
              for i, (prompt, trajs) in enumerate(started)]
    return Played(groups, runner.env_version, timings)
