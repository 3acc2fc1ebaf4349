"""External agents on the real stack: agents written against the official `openai` client play
`env.name: external_agent` runs through the gateway's HTTP listener, the rollout service's vLLM engine
generates, the learner trains.

- A multi-call tool-using agent (its tools rendered by the model's chat template, the tool's answer
  appended as a tool message, the second call streamed): each call is captured with the engine's own
  tokens and logprobs (equal to what the client received, and to transformers' logprobs of the served
  weights within 1e-4), the second call continues the first in token space, and the learner's logprobs
  match the generator's within the consistency gate of every run.
- Bad input, on the live run: each refused with a 4xx in OpenAI's shape naming the field.
- Two users' LoRA runs at once, played through the completions API: each user's agent sees its own run
  only; the other's answers 404 in the words of a run that does not exist.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time

import grpc
import httpx
import pytest
from openai import AsyncOpenAI

from rlserve.agents.capture import read
from rlserve.clients.coordinator import CoordinatorClient
from rlserve.clients.credentials import Credentials
from rlserve.data.prompts import PromptTokenizer
from rlserve.models import resolve_model
from rlserve.reference.scorer import ReferenceScorer, Sequence
from rlserve.security.users import add_user
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import (
    assert_consistent,
    assert_records_agree,
    events_until_end,
    metric_events,
    metric_rows,
    spec,
)

# The character tokenizer's alphabet only: "<s>t:calculator</s>u:47+85=</s>a:"; a tool without a
# description is refused by the template, as real templates refuse what they cannot render.
TEMPLATE = ("{{ bos_token }}{% for t in tools or [] %}{% if t['function']['description'] is not defined %}"
            "{{ raise_exception('every tool needs a description') }}{% endif %}"
            "{{ 't:' + t['function']['name'] + eos_token }}{% endfor %}"
            "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] }}"
            "{% for c in m['tool_calls'] or [] %}{{ '#' + c['function']['name'] }}{% endfor %}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "adds",
                                           "parameters": {"type": "object", "properties": {}}}}]
AGENT_ENV = {"enabled": True, "name": "external_agent", "timeout_s": 120}
SMALL_RUN = dict(grpo__num_prompts_per_step=2, grpo__num_generations_per_prompt=2, grpo__val_period=0,
                 grpo__val_at_start=False, checkpointing__enabled=False, env=AGENT_ENV)


@pytest.fixture(scope="module")
def chat_model(test_cluster):
    """The served tiny model (the rollout accepts its architecture) with a chat template that renders tools."""
    path = test_cluster.models_dir / "agent-chat-model"
    if not path.exists():
        shutil.copytree(resolve_model("preset:tiny"), path)
        (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _url(test_cluster) -> str:
    return f"{test_cluster.cluster.http_url}/v1"


async def _tool_agent(url: str, key: str, model: str, bad_input) -> tuple[int, list[dict]]:
    """Plays episodes until the run ends: a call with the tools, the calculator's sum as a tool message, a
    streamed call for the answer, a reward. Returns the episodes played and what the client received."""
    played, received = 0, []
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        while True:
            resp = await http.get(f"{url}/episodes/next", params={"model": model, "wait_s": 2})
            if resp.status_code != 200:
                assert resp.status_code == 400 and "has ended" in resp.json()["error"]["message"], resp.text
                return played, received
            ep = resp.json()
            if ep["episode_id"] is None:
                continue
            if bad_input is not None:
                await bad_input(http, ep)
                bad_input = None
            async with AsyncOpenAI(base_url=ep["base_url"], api_key=key, max_retries=0) as client:
                messages = list(ep["messages"])
                first = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                             logprobs=True)
                message = first.choices[0].message
                calls = message.tool_calls or []
                messages += [message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": calls[0].id if calls else "call-0",
                              "content": str(eval(ep["prompt"].rstrip("=")))}]  # the task's sum: the tool's answer
                stream = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                              stream=True, logprobs=True)
                chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            streamed = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs
                        for lp in c.choices[0].logprobs.content]
            received += [{"id": first.id, "text": message.content or "",
                          "logprobs": [lp.logprob for lp in first.choices[0].logprobs.content]},
                         {"id": chunks[0].id, "text": text, "logprobs": streamed}]
            # Every other episode rewarded: each group's rewards differ, so every step trains.
            done = await http.post(f"{ep['base_url']}/reward", json={"reward": float(played % 2)})
            assert done.status_code == 200, done.text
            if not played:  # a finished episode takes no second reward
                _refused(await http.post(f"{ep['base_url']}/reward", json={"reward": 1.0}), 400, "episode_id")
            played += 1


def _refused(resp: httpx.Response, status: int, param: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error


async def _bad_input(url: str, model: str, http: httpx.AsyncClient, ep: dict) -> None:
    """Each mistake a client can make, on the live run: a 4xx in OpenAI's shape naming the field."""
    chat = f"{url}/chat/completions"
    hello = [{"role": "user", "content": "1+1="}]
    _refused(await http.post(chat, json={"model": model, "messages": [{"role": "user", "content": "1" * 200}]}),
             400, "messages")  # over the model's length
    _refused(await http.post(chat, json={"model": model, "messages": hello, "frobnicate": 1}), 400, "frobnicate")
    _refused(await http.post(chat, json={"model": model, "messages": [{"role": "robot", "content": "x"}]}), 400,
             "messages[0].role")
    _refused(await http.post(chat, json={"model": model, "messages": [{"role": "user", "content": 7}]}), 400,
             "messages[0].content")
    _refused(await http.post(chat, json={"model": model, "messages": hello, "tools": [
        {"type": "function", "function": {"name": "calculator"}}]}), 400, "tools")  # the template refuses it
    _refused(await http.post(chat, json={"model": model, "messages": hello, "tools": [
        {"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}]}), 400,
             "tools[0].function.parameters")
    _refused(await http.post(chat, json={"model": model, "messages": hello, "max_tokens": 10_000}), 400,
             "max_tokens")
    _refused(await http.post(f"{ep['base_url']}/chat/completions", json={"model": model, "messages": hello, "n": 2}),
             400, "n")  # a training episode samples one completion per call
    _refused(await http.post(f"{url}/episodes/ep-nonesuch/reward", json={"reward": 1.0}), 404, "episode_id")
    _refused(await http.post(f"{ep['base_url']}/reward", content=b'{"reward": NaN}'), 400, "reward")
    _refused(await http.post(f"{ep['base_url']}/reward", json={"reward": "high"}), 400, "reward")
    _refused(await http.post(chat, content=b"{not json"), 400, None)
    _refused(await http.post(chat, json={"model": "nobody.run", "messages": hello}), 404, "model")
    # A lone call (no episode) is served and captured, and a finished episode takes no second reward.
    lone = await http.post(chat, json={"model": model, "messages": hello, "max_tokens": 2})
    assert lone.status_code == 200 and lone.json()["choices"][0]["message"]["role"] == "assistant", lone.text
    assert model in [m["id"] for m in (await http.get(f"{url}/models")).json()["data"]]


def test_a_tool_using_agent_trains_a_run_with_exact_capture(test_cluster, chat_model):
    key = test_cluster.token()
    with CoordinatorClient(test_cluster.endpoint) as client:
        run = client.submit(spec(policy__model_name=str(chat_model), data__prompt_format="chat",
                                 data__task="addition", policy__max_total_sequence_length=96,
                                 policy__generation__max_new_tokens=6, grpo__max_num_steps=2, **SMALL_RUN))
        tok = PromptTokenizer(chat_model, "chat", None)
        url = _url(test_cluster)
        played, received = asyncio.run(_tool_agent(
            url, key, run.run_id, lambda http, ep: _bad_input(url, run.run_id, http, ep)))
        events = events_until_end(client, run.run_id, timeout_s=600)
        run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert_records_agree(run, events)
    assert played == 2 * 2 * 2 and run.ledger.trained == 8
    assert_consistent(metric_events(events))  # the learner's logprobs are the generator's

    records = read(run.run_dir)
    calls = {f"chatcmpl-{r['call_id']}": r for r in records if r["kind"] == "call" and r["trains"]}
    assert len(calls) == 2 * played and {r["caller"] for r in calls.values()} == {"user"}
    for got in received:  # the capture is what the client received, token by token
        choice = calls[got["id"]]["choices"][0]
        assert choice["logprobs"] == pytest.approx(got["logprobs"], abs=1e-6)
        assert tok.tok.decode(choice["token_ids"], skip_special_tokens=True).startswith(got["text"])
    by_episode: dict[str, list[dict]] = {}
    for r in calls.values():
        by_episode.setdefault(r["episode_id"], []).append(r)
    for first, second in by_episode.values():  # the second call continues the first in token space
        done = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
        assert second["continued"] and second["prompt_token_ids"][:len(done)] == done
        new = tok.tok.decode(second["prompt_token_ids"][len(done):])  # only the tool message was rendered
        assert re.fullmatch(r"(</s>)?t:\d+</s>a:", new), new
        assert second["sequence"] == first["sequence"] == 0
    # The engine's logprobs of the initial weights are transformers' (the rollout's tolerance).
    fresh = [r for r in calls.values() if set(r["choices"][0]["versions"]) == {0}]
    scored = ReferenceScorer(chat_model).logprobs([Sequence(r["prompt_token_ids"] + r["choices"][0]["token_ids"],
                                                            len(r["prompt_token_ids"])) for r in fresh])
    assert fresh and max(abs(a - b) for r, s in zip(fresh, scored) for a, b in zip(r["choices"][0]["logprobs"], s)) < 1e-4
    rows = metric_rows(run)
    assert all(r["episode/env/calls"] == 2.0 and r["episode/env/history_rewrites"] == 0.0 for r in rows if r["step"])


async def _completion_agent(url: str, key: str, model: str) -> int:
    """Two completions per episode, the second continuing the first's text, then the reward."""
    played, scored = 0, 0.0
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        while True:
            resp = await http.get(f"{url}/episodes/next", params={"model": model, "wait_s": 2})
            if resp.status_code != 200:
                assert "has ended" in resp.json()["error"]["message"], resp.text
                return played
            ep = resp.json()
            if ep["episode_id"] is None:
                continue
            async with AsyncOpenAI(base_url=ep["base_url"], api_key=key, max_retries=0) as client:
                first = await client.completions.create(model=model, prompt=ep["prompt"], max_tokens=3)
                second = await client.completions.create(model=model, prompt=ep["prompt"] + first.choices[0].text,
                                                         max_tokens=3)
            answer = first.choices[0].text + second.choices[0].text
            # The first episode of each group scored by the run's reward functions, the second one above it.
            body = {"reward": scored + 1.0} if played % 2 else {"answer": answer}
            done = await http.post(f"{ep['base_url']}/reward", json=body)
            assert done.status_code == 200, done.text
            scored = done.json()["reward"]
            played += 1


def _known(test_cluster, key: str) -> CoordinatorClient:
    """A client with `key`, once the gateway has read the users file that holds it (it re-reads within ~1 s)."""
    client = CoordinatorClient(test_cluster.endpoint, credentials=Credentials(key))
    for _ in range(50):
        try:
            client.list()
            return client
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            time.sleep(0.1)
    raise AssertionError("the gateway never accepted the new user's token")


def test_two_users_agents_play_their_own_lora_runs_at_once(test_cluster):
    keys = {name: add_user(test_cluster.cluster.users_file, name, admin=False) for name in ("agentann", "agentben")}
    runs = {}
    for name, key in keys.items():
        with _known(test_cluster, key) as client:
            runs[name] = client.submit(spec(policy__dtensor_cfg={"lora_cfg": {"enabled": True, "dim": 8}},
                                            grpo__max_num_steps=1, **SMALL_RUN)).run_id
    url = _url(test_cluster)

    async def both() -> list[int]:
        return await asyncio.gather(*(_completion_agent(url, keys[n], runs[n]) for n in keys))

    played = asyncio.run(both())
    assert played == [4, 4]
    with httpx.Client(headers={"Authorization": f"Bearer {keys['agentann']}"}) as http:
        assert [m["id"] for m in http.get(f"{url}/models").json()["data"]] == [runs["agentann"]]
        errors = [http.post(f"{url}/completions", json={"model": m, "prompt": "1+1="})
                  for m in (runs["agentben"], "agentben.nonesuch")]
    assert [e.status_code for e in errors] == [404, 404]
    theirs, missing = (e.json()["error"] for e in errors)
    assert theirs["message"].replace(runs["agentben"], "X") == missing["message"].replace("agentben.nonesuch", "X")
    for name, run_id in runs.items():
        with _known(test_cluster, keys[name]) as client:
            events = events_until_end(client, run_id, timeout_s=600)
            run = client.get(run_id)
        assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
        assert_records_agree(run, events)
        calls = [r for r in read(run.run_dir) if r["kind"] == "call"]
        assert {r["caller"] for r in calls} == {name} and all(r["api"] == "completion" for r in calls)
        assert sum(r["continued"] for r in calls) == 4  # each episode's second call continued its first
