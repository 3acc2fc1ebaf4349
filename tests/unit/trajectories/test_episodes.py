"""Multi-turn episodes against the in-memory services: runs train episodes with a balanced ledger; each
turn continues the exact tokens of the turns before (never re-tokenized, also when the text would
tokenize differently); every ending is recorded; a failing, hanging, flooding or garbage-returning
environment drops its group with a reason and the run goes on; the engine keeps generating while
episodes wait for their environment."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import pytest
import torch

from rlserve.environments.builtins import GuessNumber
from rlserve.environments.interfaces import Environment, ResetOutput, StepInput, StepOutput
from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import run_to_end
from rlserve.loop.validation import evaluate
from rlserve.training.batch import rank_micro_batches
from rlserve.trajectories.batch import build_batch
from rlserve.trajectories.rollout import play
from rlserve.v1 import common_pb2, rollout_pb2
from tests.support.fake_services import FakeServices
from tests.support.trajectories import first_step

SETTINGS = LoopSettings(weight_store="fake", watchdog_timeout_s=60)
GAME = {"data": {"task": "guess_number", "task_args": {"max_number": 8}},
        "env": {"enabled": True, "name": "guess_number"}, "grpo": {"max_rollout_turns": 3},
        "policy": {"max_total_sequence_length": 96}}


def test_a_multi_turn_run_trains_episodes_with_a_balanced_ledger(make_run):
    run, inputs = make_run(**GAME)
    services = FakeServices()
    asyncio.run(run_to_end(run, services, SETTINGS))
    assert run.step == 4 and run.ledger.balanced() and run.ledger.trained > 0
    rows = run.recorder.read("metrics.jsonl")
    last = rows[-1]
    assert sum(last[f"episode/{e}_fraction"] for e in ("done", "max_turns", "truncated")) == pytest.approx(1.0)
    assert 1.0 <= last["episode/turns_mean"] <= 3.0 and "episode/env/success" in last
    assert "val/episode/turns_mean" in last and "timing/env_s" in last
    # One Reset per group (its episodes share the start), one Step per turn.
    assert services.calls.env_resets == 4 * 4 + 3 * 8  # 4 steps x 4 prompts, 3 validations x 8 prompts
    # The batch: the prompt, then the policy's tokens (mask 1) and the observations' (mask 0).
    batch = services.calls.batches[0]
    assert batch.loss_mask is not None and batch.loss_mask.any() and not batch.loss_mask.all()
    obs = inputs.tok.observation_ids([{"role": "user", "content": "higher"}], 0)
    comp_start = 0
    found = False
    for i in range(batch.num_seqs):
        n = int(batch.completion_lens[i])
        seq = batch.sequence(i)[int(batch.prompt_lens[i]):].tolist()
        mask = batch.loss_mask[comp_start:comp_start + n].tolist()
        context = [t for t, m in zip(seq, mask) if not m]
        if context[:len(obs)] == obs:
            found = True
        assert mask[0]  # every episode starts with the policy's turn
        comp_start += n
    assert found  # some episode heard "higher"


class Scripted(FakeServices):
    """Generation that answers turn k of every episode with `turns[k]` (finish reason `finish[k]`, or
    LENGTH when max_new_tokens cuts it), and records the prompts it was asked to continue."""

    def __init__(self, turns: list[list[int]], text, finish: list[int] | None = None, **kw):
        super().__init__(**kw)
        self.turns, self.text = turns, text
        self.finish = finish or [common_pb2.FINISH_REASON_STOP] * len(turns)
        self.prompts: list[list[int]] = []

    async def generate(self, req):
        self.calls.generate.append(req)
        prompt = list(req.prompts[0].token_ids.ids)
        # The turn: how many distinct earlier requests this one continues (episodes of a group repeat each other).
        k = len({tuple(p) for p in self.prompts if len(p) < len(prompt) and prompt[:len(p)] == p})
        self.prompts.append(prompt)
        turn = self.turns[min(k, len(self.turns) - 1)]
        ids = turn[:req.sampling.max_new_tokens]
        finish = self.finish[min(k, len(self.turns) - 1)] if ids == turn else common_pb2.FINISH_REASON_LENGTH
        sample = rollout_pb2.Sample(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish,
                                    text=self.text(ids),
                                    version_runs=[rollout_pb2.VersionRun(version=self.served, start=0, end=len(ids))])
        return rollout_pb2.GenerateResponse(completions=[rollout_pb2.Completion(samples=[sample])],
                                            weight_version=self.served, replica_id="fake")


_ids = itertools.count()


def scripted_episode(make_run, tok_text, turns, finish=None, envs=None, **over):
    """Play one validation-style step of episodes through the producer and return (groups, services)."""
    run, inputs = make_run(run_id=f"s{next(_ids)}", **over)
    services = Scripted(turns, tok_text(inputs), finish, environments=envs or {})
    groups = asyncio.run(play(services, inputs, first_step(inputs, list(inputs.train[:1])), inputs.model_path)).groups
    return groups, services, inputs


class Echo(Environment):
    """Never done: answers every turn with the same observation."""

    name = "echo"

    def __init__(self, text: str = "again"):
        self.text = text

    def step(self, step: StepInput) -> StepOutput:
        return StepOutput([{"role": "user", "content": self.text}], 0.25, False, {"turn": float(step.turn)})


CHAT = {"policy": {"model_name": "preset:tiny-chat", "max_total_sequence_length": 128,
                   "generation": {"max_new_tokens": 16}},
        "data": {"task": "addition", "prompt_format": "chat"},
        "env": {"enabled": True, "name": "echo", "import_path": "tests.unit.trajectories.test_episodes:Echo"},
        "grpo": {"max_rollout_turns": 3, "num_generations_per_prompt": 2}}


def decode_text(inputs):
    return lambda ids: inputs.tok.tok.decode(ids, skip_special_tokens=True)


def test_each_turn_continues_the_exact_tokens_and_the_template_marks_the_turns(make_run):
    """Three turns on the chat model: every request's prompt is the previous request's prompt, the tokens
    generated for it and the observation rendered by the template; nothing is re-tokenized."""
    run, inputs = make_run(**CHAT)
    tok = inputs.tok
    eot = tok.eos_ids[0]
    turn = tok.encode("12") + [eot]
    groups, services, inputs = scripted_episode(make_run, decode_text, [turn, turn, turn],
                                                envs={"echo": Echo()}, **CHAT)
    (g,) = groups
    assert [t.ending for t in g.trajectories] == ["max_turns", "max_turns"] and [t.turns for t in g.trajectories] == [3, 3] and g.rewards == [0.75, 0.75]
    obs = tok.observation_ids([{"role": "user", "content": "again"}], eot)
    assert tok.tok.decode(obs) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert g.trajectories[0].tokens == turn + obs + turn + obs + turn
    assert g.trajectories[0].mask == [True] * 3 + [False] * len(obs) + [True] * 3 + [False] * len(obs) + [True] * 3
    assert g.trajectories[0].logprobs == [-0.5] * 3 + [0.0] * len(obs) + [-0.5] * 3 + [0.0] * len(obs) + [-0.5] * 3
    # The whole trajectory is what the template gives for the conversation (the turn markers are right).
    convo = [*tok.messages(inputs.train[0]), {"role": "assistant", "content": "12"}, {"role": "user", "content": "again"},
             {"role": "assistant", "content": "12"}, {"role": "user", "content": "again"},
             {"role": "assistant", "content": "12"}]
    rendered = tok.tok.encode(tok.tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False)
    assert g.prompt_ids + g.trajectories[0].tokens == rendered[:len(g.prompt_ids) + len(g.trajectories[0].tokens)]
    # Every request continued the previous one exactly.
    prompts = sorted({tuple(p) for p in services.prompts}, key=len)
    prompts = [list(p) for p in prompts]
    assert len(prompts) == 3
    assert prompts[1] == prompts[0] + turn + obs and prompts[2] == prompts[1] + turn + obs
    # The environment saw the conversation so far and the last message apart.
    steps = list({r.turn: r for r in services.calls.env_steps}.values())  # one episode's steps, by turn
    steps.sort(key=lambda r: r.turn)
    assert [len(r.conversation) for r in steps] == [1, 3, 5] and steps[0].assistant.content == "12"
    assert steps[2].turn == 3 and steps[1].conversation[1].role == "assistant"


def test_a_trajectory_whose_text_retokenizes_differently_trains_on_its_tokens(make_run):
    """The trap: the engine wrote a word one byte-token at a time, which the tokenizer would merge. The
    training batch holds the engine's tokens, and the loss targets are exactly them."""
    run, inputs = make_run(**CHAT)
    tok = inputs.tok
    word = "the answer"
    merged = tok.encode(word)
    split = [tok.tok.convert_tokens_to_ids(c if c != " " else "Ġ") for c in word]
    assert tok.tok.decode(split) == word and merged != split  # the text re-tokenizes differently
    turn = split + [tok.eos_ids[0]]
    groups, _, _ = scripted_episode(make_run, decode_text, [turn, turn, turn], envs={"echo": Echo()}, **CHAT)
    batch = build_batch(groups, torch.tensor([[1.0, -1.0]]), with_reference=False)
    completion = batch.sequence(0)[int(batch.prompt_lens[0]):].tolist()
    assert completion[:len(turn)] == turn
    mask = batch.loss_mask[:len(completion)]
    (mb,) = rank_micro_batches(batch, [0], 0, 1, packed=True, micro_batch_size=1, mb_tokens=1024,
                               algorithm="balanced")
    assert mb.targets.tolist() == completion  # the learner predicts the engine's tokens
    assert [t for t, m in zip(completion, mask.tolist()) if m] == turn * 3
    # Each policy token carries its turn (the consistency metrics' split; context is turn 0) and, given the
    # learner's version, its age.
    turns = batch.token_turns[:len(completion)].tolist()
    assert [t for t, m in zip(turns, mask.tolist()) if m] == [1] * len(turn) + [2] * len(turn) + [3] * len(turn)
    assert all(t == 0 for t, m in zip(turns, mask.tolist()) if not m)
    aged = build_batch(groups, torch.tensor([[1.0, -1.0]]), with_reference=False, version=2)
    assert set(aged.token_ages.tolist()) == {2} and torch.equal(mb.token_turns, batch.token_turns[:len(completion)])


def test_every_ending_is_recorded(make_run):
    tok_turn = lambda inputs: inputs.tok.encode("12") + [inputs.tok.eos_ids[0]]  # noqa: E731
    run, inputs = make_run(**CHAT)
    turn = tok_turn(inputs)
    # done: the environment ends it.
    groups, _, _ = scripted_episode(make_run, decode_text, [turn], **{**CHAT, "env": {"enabled": True,
                                                                                      "name": "single_turn"}})
    assert [t.ending for t in groups[0].trajectories] == ["done", "done"] and [t.turns for t in groups[0].trajectories] == [1, 1]
    # truncated: a turn cut by max_new_tokens (the environment still scores what was said).
    long = inputs.tok.encode("1234567") + [inputs.tok.eos_ids[0]]
    groups, _, _ = scripted_episode(make_run, decode_text, [long], envs={"echo": Echo()},
                                    **{**CHAT, "policy": {**CHAT["policy"], "generation": {"max_new_tokens": 4}}})
    assert [t.ending for t in groups[0].trajectories] == ["truncated", "truncated"] and [t.turns for t in groups[0].trajectories] == [1, 1]
    # truncated: an observation that no longer fits the token budget.
    groups, _, _ = scripted_episode(make_run, decode_text, [turn, turn, turn], envs={"echo": Echo("0123456789" * 20)},
                                    **CHAT)
    assert [t.ending for t in groups[0].trajectories] == ["truncated", "truncated"] and [t.turns for t in groups[0].trajectories] == [1, 1]


class Faulty(GuessNumber):
    """Guess the number, misbehaving in episodes of odd prompts (their groups are dropped)."""

    def __init__(self, fault: str, release: threading.Event):
        super().__init__(max_number=8)
        self.fault, self.release = fault, release

    def reset(self, episode):
        if self.fault == "reset" and int(episode.id.split("/")[-1]) % 2:
            raise RuntimeError("no episode today")
        return super().reset(episode)

    def step(self, step: StepInput):
        if int(step.episode.id.split("/")[-1]) % 2 == 0 or self.fault == "reset":
            return super().step(step)
        if self.fault == "raise":
            raise RuntimeError("the environment broke")
        if self.fault == "hang":
            self.release.wait(30)
            return super().step(step)
        if self.fault == "huge":
            return StepOutput([{"role": "user", "content": "y" * 300_000}], 0.0, False)
        if self.fault == "garbage":
            return "not a step"
        if self.fault == "nan":
            return StepOutput([], float("nan"), True)
        raise AssertionError(self.fault)


@pytest.mark.parametrize("fault,reason", [("raise", "env_error"), ("hang", "env_timeout"), ("huge", "env_error"),
                                          ("garbage", "env_error"), ("nan", "env_error"), ("reset", "env_error")])
def test_a_faulty_environment_drops_its_groups_and_the_run_goes_on(make_run, fault, reason):
    release = threading.Event()
    run, _ = make_run(**{**GAME, "env": {**GAME["env"], "timeout_s": 0.5}, "grpo": {**GAME["grpo"], "max_num_steps": 2,
                                                                                    "val_period": 0}})
    services = FakeServices(environments={"guess_number": Faulty(fault, release)})
    try:
        asyncio.run(run_to_end(run, services, SETTINGS))
    finally:
        release.set()
    assert run.step == 2 and run.ledger.balanced()
    assert run.ledger.dropped[reason] > 0 and run.ledger.trained + sum(run.ledger.dropped.values()) == 32
    dropped = [ev for ev in run.events if f"dropped/{reason}" in ev.metrics]
    assert dropped and reason in dropped[0].message


def test_an_observation_too_long_for_the_budget_ends_the_episode_truncated(make_run):
    run, inputs = make_run(**GAME)
    services = FakeServices(environments={"guess_number": Echo("z" * 5000)})
    groups = asyncio.run(play(services, inputs, first_step(inputs, list(inputs.train[:2])), inputs.model_path)).groups
    assert all([t.ending for t in g.trajectories] == ["truncated"] * 4 and [t.turns for t in g.trajectories] == [1] * 4 and not g.env_failures for g in groups)


class Slow(GuessNumber):
    def __init__(self, delay_s: float):
        super().__init__(max_number=8)
        self.delay_s = delay_s

    def step(self, step):
        time.sleep(self.delay_s)
        return super().step(step)


def test_the_engine_keeps_generating_while_episodes_wait_for_their_environment(make_run):
    """16 episodes x up to 3 turns with a 0.2 s environment: one after the other they would take 3 s or
    more; each is its own task, so they overlap and generation requests run side by side."""
    run, inputs = make_run(**{**GAME, "env": {"enabled": True, "name": "guess_number", "max_concurrent_episodes": 64}})
    services = FakeServices(generate_delay_s=0.02, environments={"guess_number": Slow(0.2)})
    t0 = time.perf_counter()
    asyncio.run(play(services, inputs, first_step(inputs, list(inputs.train[:4])), inputs.model_path))
    wall = time.perf_counter() - t0
    steps = len(services.calls.env_steps)
    assert steps >= 16 and wall < 0.5 * steps * 0.2
    assert services.calls.peak >= 4


def test_validation_plays_one_greedy_episode_per_held_out_prompt(make_run):
    run, inputs = make_run(**GAME)
    metrics, errors = asyncio.run(evaluate(FakeServices(), inputs, 0))
    assert not errors and 0.0 <= metrics["val/reward"] <= 1.0
    assert {"val/episode/turns_mean", "val/episode/env/success", "val/episode/done_fraction"} <= set(metrics)


class FirstMessages(Environment):
    """Starts every episode with its own instructions and a state it then checks."""

    name = "first"

    def reset(self, episode):
        return ResetOutput([{"role": "user", "content": f"say {episode.answer}"}], {"want": episode.answer})

    def step(self, step: StepInput) -> StepOutput:
        assert step.state == {"want": step.episode.answer}
        return StepOutput([], 1.0, True)


def test_resets_messages_are_the_prompt_and_the_state_comes_back(make_run):
    run, inputs = make_run(**GAME)
    services = FakeServices(environments={"guess_number": FirstMessages()})
    played = asyncio.run(play(services, inputs, first_step(inputs, list(inputs.train[:2])), inputs.model_path))
    groups = played.groups
    assert played.version == "fake-env-guess_number"
    assert groups[0].prompt_ids == inputs.tok.episode_prompt_ids([{"role": "user",
                                                                   "content": f"say {inputs.train[0].answer}"}])
    assert all(g.rewards == [1.0] * 4 and not g.env_failures for g in groups)


def test_admission_allow_lists_environment_plug_ins_and_servers():
    from rlserve.config import RunSpec
    from rlserve.loop.admission import RunAdmission
    from rlserve.rpc import RpcError
    from rlserve.security.plugins import PluginPolicy

    admission = RunAdmission(None, PluginPolicy(["tests.unit.trajectories.test_episodes:Echo"]), ["127.0.0.1:*"], 1, None)
    ok = {"env": {"enabled": True, "name": "echo", "import_path": "tests.unit.trajectories.test_episodes:Echo",
                  "endpoint": "127.0.0.1:7000"}}
    admission._check_plugins(RunSpec.model_validate(ok))
    for env, field in [({"name": "x", "import_path": "os:system"}, "env.import_path"),
                       ({"args": {"functions": [{"name": "f", "import_path": "os:system"}]}},
                        "env.args.functions.0.import_path"),
                       ({"endpoint": "evil.example:443"}, "env.endpoint")]:
        with pytest.raises(RpcError, match=f"PERMISSION_DENIED: spec_yaml: {field}"):
            admission._check_plugins(RunSpec.model_validate({"env": {"enabled": True, **env}}))


class Down(Environment):
    def reset(self, episode):
        raise RuntimeError("down for maintenance")

    def step(self, step):
        raise AssertionError("never stepped")


def test_the_preflight_starts_an_episode(make_run):
    from rlserve.loop.admission import RunAdmission
    from rlserve.rpc import RpcError

    run, inputs = make_run(**GAME)
    example = (inputs.tok, inputs.val[0])
    asyncio.run(RunAdmission._check_environment(inputs.spec, FakeServices(), example))
    down = FakeServices(environments={"guess_number": Down()})
    with pytest.raises(RpcError, match="FAILED_PRECONDITION: env: the environment cannot start an episode: "
                                       "RuntimeError: down for maintenance"):
        asyncio.run(RunAdmission._check_environment(inputs.spec, down, example))


class Updating(Scripted):
    """A weight update lands between the first and the second turn of every episode."""

    async def generate(self, req):
        resp = await super().generate(req)
        self.served = max(self.served, 1 if len(self.prompts) >= 2 else 0)
        return resp


def test_weight_versions_are_recorded_per_turn(make_run):
    """An episode whose turns came from two weight versions is tagged with the oldest, counted as spanning
    versions, and keeps each turn's tokens with the logprobs they were sampled with."""
    run, inputs = make_run(run_id="v", **CHAT)
    turn = inputs.tok.encode("12") + [inputs.tok.eos_ids[0]]
    services = Updating([turn, turn, turn], decode_text(inputs), environments={"echo": Echo()})
    groups = asyncio.run(play(services, inputs, first_step(inputs, list(inputs.train[:1])), inputs.model_path)).groups
    (g,) = groups
    assert g.weight_version == 0 and g.mixed_samples == 2 and g.version_spread == 1
    assert [lp for lp, m in zip(g.trajectories[0].logprobs, g.trajectories[0].mask) if m] == [-0.5] * 9


@pytest.mark.parametrize("tools_json, words", [
    ("", None), ('[{"type": "function", "function": {"name": "calculator"}}]', None),
    ("not json", "Reset tools"), ('{"type": "function"}', "schemas"), ("[" + " " * 70_000 + "]", "at most")])
def test_reset_tools_from_an_environment_server_are_checked(tools_json, words):
    """An external environment server's tools are untrusted: a bad list drops the episode with env_error."""
    from rlserve.trajectories.episodes import EpisodeFailed, _tools
    from rlserve.v1 import environment_pb2

    resp = environment_pb2.ResetResponse(tools_json=tools_json)
    if words is None:
        assert _tools(resp) == (json.loads(tools_json) if tools_json else None)
    else:
        with pytest.raises(EpisodeFailed, match=words) as err:
            _tools(resp)
        assert err.value.reason == "env_error"
