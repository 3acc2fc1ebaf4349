"""Environments: the built-ins, the reward functions as a one-step environment, the service's checks on
what an environment returns, loading by name or import path, and the reward application serving
Reset and Step under the plug-in allow-list."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlserve.catalog import ENVIRONMENTS
from rlserve.environments import serving
from rlserve.environments.builtins import GuessNumber, SingleTurn
from rlserve.environments.config import EnvironmentCfg
from rlserve.environments.interfaces import Environment, Episode, ResetOutput, StepInput, StepOutput
from rlserve.environments.loader import load_environment
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.loader import CombinedReward
from rlserve.rewards.scoring import score_batch
from rlserve.rpc import RpcError
from rlserve.v1 import environment_pb2 as pb
from rlserve.v1 import reward_pb2

EXACT = CombinedReward([RewardFunctionCfg(name="exact_match")])


def episode(answer: str = "5", **env_args) -> Episode:
    return Episode("r/0/0", "guess", ({"role": "user", "content": "guess"},), answer, {}, env_args)


def step_input(text: str, turn: int = 1, ep: Episode | None = None, state=None) -> StepInput:
    return StepInput(ep or episode(), [{"role": "user", "content": "guess"}], text, state, turn)


@pytest.mark.parametrize("name", ENVIRONMENTS.names)
def test_every_catalog_environment_is_an_environment(name):
    assert issubclass(ENVIRONMENTS.load(name), Environment)


def test_single_turn_scores_like_the_reward_service_and_is_done_after_one_step():
    env = SingleTurn(EXACT)
    for text in ("5", " 5 ", "6"):
        out = env.step(step_input(text))
        scored = score_batch(EXACT, reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(
            prompt="guess", completion=text, reference_answer="5")]))
        assert out.done and out.observation == [] and out.reward == scored.results[0].score
        assert out.metrics == dict(scored.results[0].components)
    assert env.reset(episode()).messages == [{"role": "user", "content": "guess"}]


def test_guess_number_answers_higher_or_lower_until_right():
    env = GuessNumber(max_number=8, discount=0.5)
    ep = episode(target=6, max_number=8)
    high = env.step(step_input("3", 1, ep))
    assert high.observation == [{"role": "user", "content": "higher"}] and high.state["low"] == 4
    low = env.step(step_input("my guess is 7", 2, ep, high.state))
    assert low.observation[0]["content"] == "lower" and not low.done and low.reward == 0.0
    assert (low.state["low"], low.state["high"]) == (4, 6)
    right = env.step(step_input("6", 3, ep, low.state))
    assert right.done and right.reward == 0.25
    assert right.metrics == {"success": 1.0, "turns": 3.0, "invalid": 0.0, "ignored_feedback": 0.0}
    bad = env.step(step_input("nine", 1, ep))
    assert "whole number from 1 to 8" in bad.observation[0]["content"] and bad.metrics["invalid"] == 1.0
    assert env.step(step_input("12", 1, ep)).metrics["invalid"] == 1.0  # out of range
    with pytest.raises(ValueError, match="max_number"):
        GuessNumber(max_number=0)


def test_guess_number_counts_and_optionally_penalises_guesses_that_ignore_the_feedback():
    env = GuessNumber(max_number=8, feedback_penalty=0.2)
    ep = episode(target=6, max_number=8)
    first = env.step(step_input("3", 1, ep))  # higher: 4..8 stay open
    again = env.step(step_input("2", 2, ep, first.state))  # ignores "higher"
    assert again.reward == pytest.approx(-0.2) and again.metrics["ignored_feedback"] == 1.0
    fine = env.step(step_input("5", 3, ep, again.state))
    assert fine.reward == 0.0 and fine.metrics["ignored_feedback"] == 1.0 and fine.state["low"] == 6
    assert env.step(step_input("6", 4, ep, fine.state)).reward == pytest.approx(0.9 ** 3)


class Scripted(Environment):
    def __init__(self, out):
        self.out = out

    def reset(self, ep):
        return self.out if isinstance(self.out, ResetOutput) else ResetOutput([{"role": "user", "content": "hi"}])

    def step(self, step):
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


def step_request(**kw) -> pb.StepRequest:
    return pb.StepRequest(episode=pb.Episode(id="e", messages=[pb.ChatMessage(role="user", content="hi")]),
                          assistant=pb.ChatMessage(role="assistant", content="x"), turn=1, **kw)


@pytest.mark.parametrize("out,problem", [
    (RuntimeError("boom"), "RuntimeError: boom"),
    ("garbage", "step returned str, not StepOutput"),
    (StepOutput([], float("nan"), True), "reward: a finite number"),
    (StepOutput([], 1.0, "yes"), "done: a bool"),
    (StepOutput([{"role": "user"}], 1.0, False), "a message is"),
    (StepOutput([{"role": "user", "content": "y" * (serving.MAX_MESSAGES_CHARS + 1)}], 0.0, False), "characters, at most"),
    (StepOutput([], 0.0, False), "an episode that goes on needs at least one message"),
    (StepOutput([], 0.0, True, {"m": float("inf")}), "metrics.m: a finite number"),
    (StepOutput([], 0.0, True, state={1, 2}), "state: must be JSON data"),
    (StepOutput([], 0.0, True, state="s" * serving.MAX_STATE_CHARS), "state:"),
])
def test_what_breaks_the_contract_is_an_error_status_not_an_exception(out, problem):
    resp = serving.step(Scripted(out), "v1", step_request())
    assert resp.status == pb.ENVIRONMENT_STATUS_ERROR and problem in resp.error and resp.environment_version == "v1"


def test_a_good_step_and_its_state_travel_as_json():
    out = StepOutput([{"role": "tool", "content": "42"}], 0.5, False, {"hits": 2}, {"seen": [1, 2]})
    resp = serving.step(Scripted(out), "v1", step_request(state_json=json.dumps({"seen": [1]})))
    assert resp.status == pb.ENVIRONMENT_STATUS_OK and resp.reward == 0.5 and not resp.done
    assert [(m.role, m.content) for m in resp.observation] == [("tool", "42")]
    assert json.loads(resp.state_json) == {"seen": [1, 2]} and dict(resp.metrics) == {"hits": 2.0}
    with pytest.raises(RpcError, match="state_json: not JSON"):
        serving.step(Scripted(out), "v1", step_request(state_json="{"))


def test_reset_needs_messages():
    bad = serving.reset(Scripted(ResetOutput([])), "v", pb.ResetRequest(episode=pb.Episode(id="e")))
    assert bad.status == pb.ENVIRONMENT_STATUS_ERROR and "at least one message" in bad.error
    good = serving.reset(Scripted(None), "v", pb.ResetRequest(episode=pb.Episode(id="e")))
    assert good.status == pb.ENVIRONMENT_STATUS_OK and good.messages[0].content == "hi" and good.state_json == "null"


def test_loading_by_name_and_import_path():
    assert isinstance(load_environment(EnvironmentCfg(name="guess_number", args={"max_number": 4}), lambda: EXACT),
                      GuessNumber)
    default = load_environment(EnvironmentCfg(), lambda: EXACT)
    assert isinstance(default, SingleTurn) and default.reward is EXACT
    own = load_environment(EnvironmentCfg(args={"functions": [{"name": "format", "args": {"pattern": "x"}}]}),
                           lambda: EXACT)
    assert own.reward is not EXACT
    with pytest.raises(ValueError, match="unknown environment 'nope'.*single_turn, guess_number"):
        load_environment(EnvironmentCfg(name="nope"), lambda: EXACT)
    with pytest.raises(ValueError, match="not a subclass"):
        load_environment(EnvironmentCfg(name="x", import_path="json:dumps"), lambda: EXACT)
    with pytest.raises(ValueError, match="bad args"):
        load_environment(EnvironmentCfg(name="guess_number", args={"colour": 1}), lambda: EXACT)
    with pytest.raises(ValueError, match="single_turn takes only \['functions'\]"):
        load_environment(EnvironmentCfg(args={"x": 1}), lambda: EXACT)


def test_the_reward_application_serves_environments_under_the_allow_list():
    from services.reward.app import Reward

    app = Reward.func_or_class({"allowed_plugins": ["tests.unit.environments.test_environments:Scripted"]})
    ep = pb.Episode(id="r/0/0", prompt="guess", messages=[pb.ChatMessage(role="user", content="guess")],
                    reference_answer="3", env_args_json=json.dumps({"target": 3, "max_number": 4}))
    game = EnvironmentCfg(name="guess_number").to_proto()
    reset = asyncio.run(app.Reset(pb.ResetRequest(environment=game, episode=ep)))
    assert reset.status == pb.ENVIRONMENT_STATUS_OK and reset.messages[0].content == "guess"
    step = asyncio.run(app.Step(pb.StepRequest(environment=game, episode=ep, turn=1,
                                               assistant=pb.ChatMessage(role="assistant", content="3"))))
    assert step.done and step.reward == 1.0 and step.environment_version == reset.environment_version
    # single_turn without functions scores with the deployed default (exact_match).
    one = asyncio.run(app.Step(pb.StepRequest(environment=EnvironmentCfg().to_proto(), episode=ep, turn=1,
                                              assistant=pb.ChatMessage(role="assistant", content="3"))))
    assert one.done and one.reward == 1.0
    with pytest.raises(RpcError, match="PERMISSION_DENIED: environment.import_path"):
        asyncio.run(app.Reset(pb.ResetRequest(environment=pb.EnvironmentSpec(name="x", import_path="os:system"),
                                              episode=ep)))
    with pytest.raises(RpcError, match="PERMISSION_DENIED: environment.args_json: functions.0.import_path"):
        asyncio.run(app.Reset(pb.ResetRequest(environment=EnvironmentCfg(args={"functions": [
            {"name": "f", "import_path": "os:system"}]}).to_proto(), episode=ep)))
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: environment.args_json"):
        asyncio.run(app.Reset(pb.ResetRequest(environment=pb.EnvironmentSpec(name="guess_number", args_json="[1]"),
                                              episode=ep)))
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: environment: unknown environment"):
        asyncio.run(app.Reset(pb.ResetRequest(environment=pb.EnvironmentSpec(name="chess"), episode=ep)))


def test_the_standalone_server_serves_environments_under_its_allow_list():
    """scripts/reward_server.py (loaded from its file) answers Reset and Step like the reward application."""
    import importlib.util
    from pathlib import Path

    import grpc

    from rlserve.v1 import environment_pb2_grpc
    from tests.support.dist import free_port

    path = Path(__file__).resolve().parents[3] / "scripts" / "reward_server.py"
    module_spec = importlib.util.spec_from_file_location("reward_server_under_test", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    port = free_port()
    server = module.serve("127.0.0.1", port, ["exact_match"], [])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = environment_pb2_grpc.EnvironmentStub(channel)
            ep = pb.Episode(id="e", prompt="guess", messages=[pb.ChatMessage(role="user", content="guess")],
                            env_args_json=json.dumps({"target": 2, "max_number": 4}))
            game = EnvironmentCfg(name="guess_number").to_proto()
            assert stub.Reset(pb.ResetRequest(environment=game, episode=ep)).status == pb.ENVIRONMENT_STATUS_OK
            step = stub.Step(pb.StepRequest(environment=game, episode=ep, turn=1,
                                            assistant=pb.ChatMessage(role="assistant", content="1")))
            assert not step.done and step.observation[0].content == "higher"
            with pytest.raises(grpc.RpcError) as err:
                stub.Reset(pb.ResetRequest(environment=pb.EnvironmentSpec(name="x", import_path="os:system"),
                                           episode=ep))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(0)
