"""One external_agent run's side of the endpoint while an attempt of it runs: the episodes it offers and
agents play, every model call of them (captured token by token), and each ended episode as a `Trajectory`.

An episode is
    offered     by the run's producer or validation (`trajectories/external.py`): `n` episodes of one data
                row share its task id, and are a group -- or started by an agent for a task of its own
                (`env.args.tasks: agent`), grouped by the task id it names, `n` at a time;
    handed out  by `next` (at most `env.max_concurrent_episodes` unfinished at once); from then the agent
                has `env.timeout_s` to end it, else it is abandoned and its group dropped
                (`episode_abandoned`, counted in the ledger when the step is committed);
    ended       by `end`: the agent's reward, or the run's reward functions' score of its answer.
A call that names no episode is an episode of its own: captured, never trained on.

Calls are token-exact. A chat call whose messages are an earlier call's messages, then one of that
call's completions as the assistant message, then new messages (tool results, the user's turn), is
continued in token space: that call's prompt tokens, the completion's tokens as the engine generated
them, then only the new messages rendered (`PromptTokenizer.observation_ids`), so nothing generated is
re-tokenized. Any other call is rendered whole. Its prompt then joins the episode's training sequence
it extends (the sequence's prompt and tokens are a prefix of it: the tokens between are context, loss
mask 0); a prompt that extends none (the agent rewrote its history: dropped turns, a summary, edited
text) starts another sequence, trained with the episode's reward too and counted in
`episode/env/history_rewrites`.

A training episode samples with the run's `policy.generation` (greedy for validation when
`grpo.val_greedy`), whatever its request asks, as the trainer's importance weights assume; a lone call
samples as asked. Every call goes through the rollout service with the run's id, adapter and priority
(its fair share of the engines) from at least the weight version its episode was offered at.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from rlserve.agents import messages as msgs
from rlserve.agents.capture import Capture
from rlserve.agents.config import ExternalAgentArgs
from rlserve.data.tasks import Example
from rlserve.loop.inputs import RunInputs
from rlserve.loop.services import RunServices
from rlserve.rpc import RpcError, failed_precondition, invalid_argument, not_found, out_of_range, unavailable
from rlserve.trajectories.generation import sampling_params
from rlserve.trajectories.single_turn import score
from rlserve.trajectories.timings import BatchTimings
from rlserve.trajectories.trajectory import Trajectory
from rlserve.v1 import agents_pb2, common_pb2, reward_pb2, rollout_pb2

# Ended episodes remembered by id, so that a late reward hears "has ended" rather than "unknown".
ENDED_KEPT = 10_000
ABANDONED = "episode_abandoned"
EMPTY = "episode_empty"
MAX_N = 16


@dataclass(frozen=True)
class Call:
    keys: tuple | None  # the chat's messages as `message_key`s (None: a plain prompt)
    tools: str
    prompt_text: str | None
    prompt_ids: list[int]
    # Per completion: the assistant messages it may come back as (keys), its token ids and text.
    choices: list[tuple[frozenset, list[int], str]]


@dataclass
class Episode:
    id: str
    task_id: str
    example: Example
    validation: bool
    trains: bool  # its trajectory goes to a group (a lone call's does not)
    greedy: bool
    min_version: int
    timings: BatchTimings
    done: asyncio.Future
    calls: list[Call] = field(default_factory=list)
    sequences: list[Trajectory] = field(default_factory=list)  # each with its own prompt_ids
    rewrites: int = 0
    ended: str = ""  # how: "reward", "abandoned", "withdrawn"
    counted: bool = False  # holds one of the run's max_concurrent_episodes places
    timer: asyncio.TimerHandle | None = None
    last_content: str = ""  # the last completion's content (what the reward functions score by default)
    last_finish: int = common_pb2.FINISH_REASON_STOP


def trajectory_of(ep: Episode) -> Trajectory:
    """The episode's sequences as one trajectory: the first sequence's prompt and tokens, then each later
    sequence's tokens after a restart at its own prompt."""
    traj = Trajectory(prompt_ids=list(ep.sequences[0].prompt_ids) if ep.sequences else None)
    for k, seq in enumerate(ep.sequences):
        offset = len(traj.tokens)
        if k:
            traj.restarts.append((offset, list(seq.prompt_ids)))
        traj.tokens += seq.tokens
        traj.logprobs += seq.logprobs
        traj.mask += seq.mask
        traj.versions += [(v, offset + a, offset + b) for v, a, b in seq.versions]
    traj.turns = len(ep.calls)
    traj.ending = "truncated" if ep.last_finish == common_pb2.FINISH_REASON_LENGTH else "done"
    traj.env_metrics = {"calls": float(len(ep.calls)), "history_rewrites": float(ep.rewrites),
                        "sequences": float(len(ep.sequences))}
    return traj


class AgentSession:
    def __init__(self, inputs: RunInputs, services: RunServices):
        self.inputs, self.services = inputs, services
        self.spec = inputs.spec
        self.args = ExternalAgentArgs.parse(self.spec.env.args)
        self.renderer = msgs.Renderer(inputs.tok, self.args)
        self.capture = Capture(inputs.run_dir)
        self.episodes: dict[str, Episode] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.offered: deque[Episode] = deque()
        self.changed = asyncio.Condition()
        self.unfinished = 0
        self.version = 0  # the newest weight version a play asked for (calls outside episodes use it)
        self.own: dict[str, list[Episode]] = {}  # an agent's own task -> its episodes not yet in a group
        self.own_ready: deque[list[Episode]] = deque()
        self.own_timings = BatchTimings()
        self.closed = False
        # The run's tokenizer works off the event loop, one render at a time.
        self.renders = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"agents-{inputs.run_id}"[:60])

    # --- episodes ---------------------------------------------------------------------------------

    def _new(self, task_id: str, example: Example, validation: bool, trains: bool, greedy: bool, min_version: int,
             timings: BatchTimings) -> Episode:
        return Episode(f"ep-{secrets.token_hex(12)}", task_id, example, validation, trains, greedy, min_version,
                       timings, asyncio.get_running_loop().create_future())

    def offer(self, example: Example, task_id: str, validation: bool, greedy: bool, min_version: int,
              timings: BatchTimings) -> Episode:
        """An episode of `example` for the next agent that asks (its `done` gives its trajectory)."""
        self.version = max(self.version, min_version)
        ep = self._new(task_id, example, validation, True, greedy, min_version, timings)
        self.episodes[ep.id] = ep
        self.offered.append(ep)
        self._wake()
        return ep

    def withdraw(self, episodes: list[Episode]) -> None:
        """The play that offered them was cancelled (its attempt ended): they end unplayed or half played."""
        for ep in episodes:
            if not ep.ended:
                self._end(ep, "withdrawn")

    async def next(self, wait_s: float) -> Episode | None:
        """The next offered episode, handed out now (None within `wait_s`)."""
        limit = self.spec.env.max_concurrent_episodes

        def ready() -> bool:
            return self.closed or bool(self.offered) and self.unfinished < limit

        async with self.changed:
            if not ready():
                try:
                    await asyncio.wait_for(self.changed.wait_for(ready), max(0.0, wait_s))
                except asyncio.TimeoutError:
                    return None
            if self.closed:
                return None
            ep = self.offered.popleft()
        self._hand_out(ep)
        return ep

    def start(self, task_id: str, answer: str) -> Episode:
        """An episode of the agent's own task (`env.args.tasks: agent`)."""
        if self.args.tasks != "agent":
            raise failed_precondition(f"task_id: run {self.inputs.run_id!r} hands out its own tasks "
                                      f"(env.args.tasks: run): take them from GET /v1/episodes/next")
        if not task_id:
            raise invalid_argument("task_id", "required: the episodes of one task form a group")
        if self.unfinished >= self.spec.env.max_concurrent_episodes:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"run {self.inputs.run_id!r} has env.max_concurrent_episodes "
                           f"({self.spec.env.max_concurrent_episodes}) episodes in progress")
        ep = self._new(task_id, Example("", answer), False, True, False, self.version, self.own_timings)
        self.episodes[ep.id] = ep
        self.own.setdefault(task_id, []).append(ep)
        self._hand_out(ep)
        return ep

    async def own_groups(self, count: int) -> tuple[list[list[Episode]], BatchTimings]:
        """The next `count` groups of the agents' own tasks, as they complete, and their calls' timings."""
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.own_ready) >= count)
            groups = [self.own_ready.popleft() for _ in range(count)]
        timings, self.own_timings = self.own_timings, BatchTimings()
        return groups, timings

    def _hand_out(self, ep: Episode) -> None:
        ep.counted = True
        self.unfinished += 1
        ep.timer = asyncio.get_running_loop().call_later(self.spec.env.timeout_s, self._abandon, ep)

    def _abandon(self, ep: Episode) -> None:
        if not ep.ended:
            self._end(ep, "abandoned", failure=(ABANDONED, (
                f"episode {ep.id} did not end within env.timeout_s ({self.spec.env.timeout_s:g}s) of being "
                f"handed out ({len(ep.calls)} calls)")))

    def episode(self, episode_id: str) -> Episode:
        """An open episode of this run; one that ended, or none, is an error naming `episode_id`."""
        ep = self.episodes.get(episode_id)
        if ep is not None:
            return ep
        if episode_id in self.ended:
            raise failed_precondition(f"episode_id: episode {episode_id!r} has ended ({self.ended[episode_id]})")
        raise not_found(f"episode_id: no episode {episode_id!r} in run {self.inputs.run_id!r}")

    def knows(self, episode_id: str) -> bool:
        return episode_id in self.episodes or episode_id in self.ended

    def _end(self, ep: Episode, how: str, reward: float | None = None, failure: tuple[str, str] | None = None,
             reward_error: str | None = None) -> Trajectory:
        ep.ended = how
        if ep.timer is not None:
            ep.timer.cancel()
        if ep.counted:
            self.unfinished -= 1
        self.episodes.pop(ep.id, None)
        if ep in self.offered:
            self.offered.remove(ep)
        self.ended[ep.id] = how
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        traj = trajectory_of(ep)
        traj.reward = reward if reward is not None else 0.0
        traj.reward_error = reward_error
        if failure is None and not ep.sequences and how == "reward":
            failure = (EMPTY, f"episode {ep.id} ended without a model call")
        traj.failure = failure
        self.capture.episode(ep.id, ep.task_id, how, reward, len(ep.calls), len(ep.sequences),
                             failure[1] if failure else reward_error or "")
        if not ep.done.done():
            ep.done.set_result(traj)
        if ep.task_id in self.own:
            self._group_own(ep.task_id)
        self._wake()
        return traj

    def _group_own(self, task_id: str) -> None:
        waiting, n = self.own[task_id], self.spec.grpo.num_generations_per_prompt
        if len(waiting) >= n and all(ep.ended for ep in waiting[:n]):
            self.own_ready.append(waiting[:n])
            del waiting[:n]
        if not waiting:
            del self.own[task_id]

    async def end(self, req: agents_pb2.EndEpisodeRequest) -> agents_pb2.EndEpisodeResponse:
        """End an episode with the agent's reward, or the run's reward functions' score of its answer."""
        ep = self.episode(req.episode_id)
        reward_error = None
        if req.HasField("reward"):
            if not math.isfinite(req.reward):
                raise invalid_argument("reward", f"must be a finite number, got {req.reward}")
            reward = req.reward
        else:
            answer = req.answer or ep.last_content
            if not (req.answer or ep.calls):
                raise invalid_argument("reward", f"episode {ep.id} has no call and no answer to score: send a reward")
            item = reward_pb2.ScoreItem(id=ep.id, prompt=ep.example.prompt, completion=answer,
                                        reference_answer=ep.example.answer)
            result = (await score(self.services, self.inputs, [item], ep.timings)).results[0]
            reward = result.score
            if result.status == reward_pb2.SCORE_STATUS_ERROR:
                reward_error = result.error or "the reward service gave no message"
            if ep.ended:
                raise failed_precondition(f"episode_id: episode {ep.id} has ended ({ep.ended}) while it was scored")
        self._end(ep, "reward", reward, reward_error=reward_error)
        return agents_pb2.EndEpisodeResponse(episode_id=ep.id, reward=reward, reward_error=reward_error or "",
                                             calls=len(ep.calls), sequences=len(ep.sequences))

    # --- calls --------------------------------------------------------------------------------------

    async def chat(self, req: agents_pb2.ChatRequest, caller: str) -> agents_pb2.ChatResponse:
        """One model call; a training episode's joins its sequences."""
        if req.episode_id:
            ep = self.episode(req.episode_id)
        else:
            ep = self._new("", Example("", ""), False, False, False, self.version, BatchTimings())
        n = req.n or 1
        if not 1 <= n <= MAX_N:
            raise invalid_argument("n", f"must be in 1..{MAX_N}, got {n}")
        if ep.trains and n != 1:
            raise invalid_argument("n", f"a training episode samples one completion per call (its group holds "
                                        f"grpo.num_generations_per_prompt = {self.spec.grpo.num_generations_per_prompt} "
                                        f"episodes of the task), got {n}")
        tools = _tools(req)
        loop = asyncio.get_running_loop()
        prompt, continued, keys = await loop.run_in_executor(self.renders, self._prompt, ep, req, tools)
        params = self._sampling(ep, req, len(prompt))
        spec = self.spec
        t0 = time.perf_counter()
        resp = await self.services.generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt))], num_samples=n, sampling=params,
            min_weight_version=ep.min_version, run_id=self.inputs.run_id, shared_base=spec.shares_deployed_base,
            priority=spec.priority))
        ep.timings.record_generate(resp, time.perf_counter() - t0)
        if self.closed:
            raise unavailable(f"model: run {self.inputs.run_id!r} stopped serving this attempt's episodes while "
                              f"the call generated; try again")
        samples = list(resp.completions[0].samples)
        choices = await loop.run_in_executor(self.renders, self._choices, samples, req, tools is not None)
        out = agents_pb2.ChatResponse(episode_id=ep.id, call_id=f"{secrets.token_hex(12)}", prompt_tokens=len(prompt),
                                      choices=choices, weight_version=resp.weight_version, continued=continued)
        ep.calls.append(Call(keys, msgs.tools_key(tools), req.prompt_text if req.plain else None, prompt, [
            (_assistant_keys(c), list(c.token_ids), c.text) for c in choices]))
        ep.last_content = choices[0].content if choices else ""
        ep.last_finish = choices[0].finish_reason if choices else common_pb2.FINISH_REASON_STOP
        sequence = self._join(ep, prompt, samples[0]) if ep.trains and not ep.ended and samples else None
        self.capture.call(out, prompt, task_id=ep.task_id, validation=ep.validation, trains=ep.trains, caller=caller,
                          api="completion" if req.plain else "chat", sequence=sequence)
        return out

    def _prompt(self, ep: Episode, req: agents_pb2.ChatRequest, tools: list[dict] | None
                ) -> tuple[list[int], bool, tuple | None]:
        """(prompt token ids, whether they continue an earlier call, the messages' keys)."""
        limit = self.spec.policy.max_total_sequence_length
        if req.plain:
            prompt, continued = self._plain_prompt(ep, req)
            keys, field = None, "prompt"
        else:
            messages = msgs.to_dicts(req.messages)
            keys = tuple(msgs.message_key(m) for m in messages)
            prompt, continued = self._chat_prompt(ep, messages, keys, tools)
            field = "messages"
        if len(prompt) >= limit:
            raise out_of_range(field, f"the prompt takes {len(prompt)} tokens; run {self.inputs.run_id!r} "
                                     f"takes at most {limit} tokens (policy.max_total_sequence_length), its "
                                     f"completion included")
        return prompt, continued, keys

    def _chat_prompt(self, ep: Episode, messages: list[msgs.Message], keys: tuple, tools: list[dict] | None
                     ) -> tuple[list[int], bool]:
        for call in reversed(ep.calls):
            k = len(call.keys) if call.keys is not None else -1
            if k < 0 or call.tools != msgs.tools_key(tools) or len(keys) <= k or keys[:k] != call.keys:
                continue
            for choice_keys, ids, _ in call.choices:
                if keys[k] in choice_keys:
                    tail = self.renderer.continuation_ids(messages[k + 1:], ids[-1] if ids else -1)
                    return call.prompt_ids + ids + tail, True
        if not messages:
            raise invalid_argument("messages", "at least one message is required")
        return self.renderer.prompt_ids(messages, tools), False

    def _plain_prompt(self, ep: Episode, req: agents_pb2.ChatRequest) -> tuple[list[int], bool]:
        if req.prompt_token_ids:
            vocab = len(self.inputs.tok.tok)
            bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid_argument("prompt", f"token id {bad} is not in the model's vocabulary (0..{vocab - 1})")
            return list(req.prompt_token_ids), False
        text = req.prompt_text
        for call in reversed(ep.calls):
            for _, ids, completion in call.choices:
                if call.prompt_text is not None and text.startswith(call.prompt_text + completion):
                    rest = text[len(call.prompt_text) + len(completion):]
                    return call.prompt_ids + ids + (self.inputs.tok.encode(rest) if rest else []), True
        if not text:
            raise invalid_argument("prompt", "must not be empty")
        return self.inputs.tok.tok.encode(text, add_special_tokens=True), False

    def _sampling(self, ep: Episode, req: agents_pb2.ChatRequest, prompt_len: int) -> common_pb2.SamplingParams:
        limit = self.spec.policy.max_total_sequence_length
        room = limit - prompt_len
        params = sampling_params(self.inputs, ep.greedy, req.seed if req.HasField("seed") else None)
        if req.HasField("max_tokens"):
            if not 1 <= req.max_tokens <= room:
                raise invalid_argument("max_tokens", f"{req.max_tokens} tokens after a prompt of {prompt_len} do not "
                                                     f"fit run {self.inputs.run_id!r}'s {limit} "
                                                     f"(policy.max_total_sequence_length): at most {room}")
            params.max_new_tokens = req.max_tokens
        else:
            params.max_new_tokens = min(params.max_new_tokens, room)
        if not ep.trains:  # a lone call samples as asked; a training episode as the run trains
            if req.HasField("temperature"):
                params.temperature = req.temperature
            if req.HasField("top_p"):
                params.top_p = req.top_p
        params.stop_strings.extend(req.stop)
        return params

    def _choices(self, samples: list[rollout_pb2.Sample], req: agents_pb2.ChatRequest, with_tools: bool
                 ) -> list[agents_pb2.ChatChoice]:
        out = []
        tok = self.inputs.tok.tok
        for s in samples:
            content, calls = (s.text, [])
            if with_tools and not req.plain:
                content, calls = self.renderer.tool_calls(s.text)
            out.append(agents_pb2.ChatChoice(
                token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason, text=s.text,
                content=content, tool_calls=calls, version_runs=s.version_runs,
                token_texts=[tok.decode([t]) for t in s.token_ids] if req.token_texts else []))
        return out

    def _join(self, ep: Episode, prompt: list[int], sample: rollout_pb2.Sample) -> int:
        """The sequence the call joins (the one whose prompt and tokens its prompt extends), or a new one."""
        for k in range(len(ep.sequences) - 1, -1, -1):
            seq = ep.sequences[k]
            whole = seq.prompt_ids + seq.tokens
            if len(prompt) >= len(whole) and prompt[:len(whole)] == whole:
                seq.add(prompt[len(whole):], None)
                seq.add(list(sample.token_ids), list(sample.logprobs), sample.version_runs)
                return k
        if ep.sequences:
            ep.rewrites += 1
        seq = Trajectory(prompt_ids=list(prompt))
        seq.add(list(sample.token_ids), list(sample.logprobs), sample.version_runs)
        ep.sequences.append(seq)
        return len(ep.sequences) - 1

    # --- the session ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        async def notify() -> None:
            async with self.changed:
                self.changed.notify_all()
        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:
            pass  # no event loop: nobody waits

    def close(self) -> None:
        """The attempt ended: open episodes are withdrawn, agents waiting in `next` are answered."""
        if self.closed:
            return
        self.closed = True
        for ep in list(self.episodes.values()):
            if not ep.ended:
                self._end(ep, "withdrawn")
        self._wake()  # agents waiting in `next` hear of it at once
        self.capture.close()
        self.renders.shutdown(wait=False)


def _tools(req: agents_pb2.ChatRequest) -> list[dict] | None:
    if req.plain or req.tools_off or not req.tools_json:
        return None
    try:
        tools = json.loads(req.tools_json)
    except ValueError as err:
        raise invalid_argument("tools", f"not JSON: {err}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise invalid_argument("tools", 'a list of {"type": "function", "function": {"name": ..., ...}}')
    return tools or None


def _assistant_keys(choice: agents_pb2.ChatChoice) -> frozenset:
    """The assistant messages a completion may come back as: its content and calls as returned, or its text."""
    calls = [{"function": {"name": c.name, "arguments": c.arguments}} for c in choice.tool_calls]
    return frozenset({msgs.message_key({"role": "assistant", "content": choice.content, "tool_calls": calls}),
                      msgs.message_key({"role": "assistant", "content": choice.text})})


def session_for(services: RunServices, inputs: RunInputs) -> AgentSession:
    """The run's session for this attempt (opened at its first play; one of an earlier attempt is closed)."""
    table = services.agent_sessions()
    session = table.get(inputs.run_id)
    if not isinstance(session, AgentSession) or session.inputs is not inputs or session.closed:
        session = AgentSession(inputs, services)
        table.put(inputs.run_id, session)
    return session
