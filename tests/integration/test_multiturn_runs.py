"""Multi-turn runs on the real stack: the built-in guess_number game served by the reward application
through SubmitRun, the preflight, episodes over Serve handles and training with the loss mask; and an
external environment server (`env.endpoint`) whose environment fails, hangs and floods on some
prompts: those groups are dropped with their reasons, the rest train, and the ledger balances; and
the tool_use environment's calls, the python tool sandboxed inside the Serve replica."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.environments import serving
from rlserve.environments.interfaces import Environment, StepInput, StepOutput
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import environment_pb2_grpc
from tests.integration.runs_support import assert_consistent, assert_records_agree, events_until_end, metric_rows, spec
from tests.support.dist import free_port

# A 1..3 game: a random model names the right number now and then within 3 turns, so groups differ.
GAME = dict(data__task="guess_number", data__task_args={"max_number": 3}, data__num_val=3,
            env={"enabled": True, "name": "guess_number", "args": {"max_number": 3}, "timeout_s": 5},
            grpo__max_rollout_turns=3, grpo__max_num_steps=2, grpo__val_period=2,
            policy__max_total_sequence_length=96, policy__generation__max_new_tokens=3, reward__functions=None)


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def finished(client: CoordinatorClient, text: str) -> tuple[pb.Run, list[pb.RunEvent]]:
    run = client.submit(text)
    events = events_until_end(client, run.run_id, timeout_s=600)
    return client.get(run.run_id), events


def test_a_guess_number_run_plays_episodes_through_the_reward_application(client):
    run, events = finished(client, spec(**GAME))
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert_records_agree(run, events)
    rows = [r for r in metric_rows(run) if r["step"] >= 1]
    assert all(1.0 <= r["episode/turns_mean"] <= 3.0 for r in rows)
    assert all(abs(sum(r[f"episode/{e}_fraction"] for e in ("done", "max_turns", "truncated")) - 1) < 1e-6
               for r in rows)
    assert "val/episode/env/success" in metric_rows(run)[-1]
    assert run.ledger.generated == 2 * 8 * 4
    assert_consistent(rows)  # vLLM (CPU, fp32), dense, full weights, multi-turn


class Unreliable(Environment):
    """Failing on prompts 1 (raises), 2 (hangs past the run's timeout) and 3 (an observation beyond the
    service's bounds) of every step; elsewhere one turn scored by the answer's length (so groups differ
    and train)."""

    def __init__(self, release: threading.Event):
        self.release = release

    def step(self, step: StepInput) -> StepOutput:
        prompt = int(step.episode.id.split("/")[-1]) % 8
        if prompt == 1:
            raise RuntimeError("the game server crashed")
        if prompt == 2:
            self.release.wait(30)
        if prompt == 3:
            return StepOutput([{"role": "user", "content": "z" * (serving.MAX_MESSAGES_CHARS + 1)}], 0.0, False)
        return StepOutput([], float(len(step.assistant) % 3), True)


class Servicer(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, env):
        self.env = env

    def Reset(self, request, context):
        return serving.reset(self.env, "external-1", request)

    def Step(self, request, context):
        return serving.step(self.env, "external-1", request)


@pytest.fixture
def environment_server():
    release = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    environment_pb2_grpc.add_EnvironmentServicer_to_server(Servicer(Unreliable(release)), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"127.0.0.1:{port}"
    release.set()
    server.stop(0)


def test_an_external_environment_that_fails_hangs_and_floods_drops_those_groups(client, environment_server):
    t0 = time.monotonic()
    run, events = finished(client, spec(**{**GAME, "env": {**GAME["env"], "endpoint": environment_server,
                                                           "timeout_s": 3}, "grpo__val_period": 0}))
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert_records_agree(run, events)
    dropped = dict(run.ledger.dropped)
    assert dropped.get("env_error", 0) >= 2 * 2 * 4 and dropped.get("env_timeout", 0) >= 2 * 4, dropped
    messages = " ".join(ev.message for ev in events if ev.kind == pb.EVENT_KIND_DROPPED)
    assert "the game server crashed" in messages and "took more than env.timeout_s" in messages
    assert "characters, at most" in messages
    assert time.monotonic() - t0 < 300


def test_the_reward_application_serves_tool_calls_with_the_python_tool_sandboxed(channel):
    """The built-in tool_use environment over the real Environment service: a call to the python tool
    runs in the sandbox inside the Serve replica (no network, only its own files), the answer comes
    back as a tool response, and the policy's answer without a call ends the episode, scored."""
    from rlserve.environments.tools.sandbox import SandboxUnavailable, run_python
    from rlserve.v1 import environment_pb2

    try:
        run_python("pass")
    except SandboxUnavailable as err:
        pytest.skip(f"this host cannot build the sandbox: {err}")
    stub = environment_pb2_grpc.EnvironmentStub(channel)
    env = environment_pb2.EnvironmentSpec(name="tool_use", args_json='{"tools": ["python", "calculator"], '
                                          '"functions": [{"name": "exact_match"}]}')
    episode = environment_pb2.Episode(id="itest", prompt="6 * 7?", reference_answer="42",
                                      messages=[environment_pb2.ChatMessage(role="user", content="6 * 7?")])
    reset = stub.Reset(environment_pb2.ResetRequest(environment=env, episode=episode, run_id="itest-tools"))
    assert reset.status == environment_pb2.ENVIRONMENT_STATUS_OK, reset.error
    assert '"name": "python"' in reset.messages[0].content
    code = ("import os, socket\\nprint(6 * 7, os.getuid() != 0, sorted(os.listdir('/')))\\n"
            "try:\\n    socket.create_connection(('127.0.0.1', 9000), timeout=1)\\n    print('NET')\\n"
            "except OSError:\\n    print('no network')")
    call = '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'
    step = stub.Step(environment_pb2.StepRequest(
        environment=env, episode=episode, conversation=reset.messages, state_json=reset.state_json, turn=1,
        assistant=environment_pb2.ChatMessage(role="assistant", content=call), run_id="itest-tools"))
    assert step.status == environment_pb2.ENVIRONMENT_STATUS_OK and not step.done, step.error
    assert step.observation[0].content == ("<tool_response>\n42 True ['dev', 'lib', 'lib64', 'root', 'usr', "
                                           "'work']\nno network\n\n</tool_response>")
    last = stub.Step(environment_pb2.StepRequest(
        environment=env, episode=episode, state_json=step.state_json, turn=2,
        assistant=environment_pb2.ChatMessage(role="assistant", content="42"), run_id="itest-tools"))
    assert last.done and last.reward == 1.0 and last.metrics["tool_calls"] == 1.0
