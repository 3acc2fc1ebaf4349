"""Every mistake a client can make gets a 4xx in OpenAI's shape naming the field (never a 500), over the real
listener; the tools declared in a system message read as the tool_use environment writes them."""

from __future__ import annotations

import asyncio

import httpx

from rlserve.agents.messages import declaration
from rlserve.agents.session import session_for
from rlserve.data.tasks import Example
from rlserve.environments.tool_use import SCHEMAS, _system_prompt
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.inputs import RunInputs
from rlserve.trajectories.timings import BatchTimings
from tests.unit.agents.conftest import TOOLS

HELLO = [{"role": "user", "content": "What is 12*34?"}]


def _open(ep, run):
    """The run's session, as its first play opens it."""
    inputs = RunInputs.build(run.run_id, run.spec, run.run_dir, algorithm_class(run.spec).data)
    return session_for(ep.services, inputs)


def test_bad_input_is_refused_in_openais_shape_naming_the_field(endpoint):
    async def scenario():
        async with endpoint() as ep:
            run = ep.run()
            plain = ep.run("plain", env={"enabled": False})
            template = ep.run("template", env={"enabled": True, "name": "external_agent",
                                               "args": {"declare_tools": "template"}})
            session = _open(ep, run)
            _open(ep, template)
            offered = session.offer(Example("What is 12*34?", "408"), "t", False, False, 0, BatchTimings())
            handed = await session.next(0)
            assert handed is offered
            url, model = ep.url, run.run_id
            chat = f"{url}/chat/completions"
            episode = f"{url}/episodes/{handed.id}"
            results = []
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ep.keys['alice']}"}) as http:
                async def refused(status, param, method, path, **kw):
                    resp = await http.request(method, path, **kw)
                    results.append((param, resp.status_code, resp.json()))
                    assert resp.status_code == status, (param, resp.text)
                    error = resp.json()["error"]
                    assert error["param"] == param and error["message"] and error["type"], (param, error)

                body = {"model": model, "messages": HELLO}
                await refused(400, "frobnicate", "POST", chat, json={**body, "frobnicate": True})
                await refused(400, "model", "POST", chat, json={"messages": HELLO})
                await refused(404, "model", "POST", chat, json={**body, "model": "nonesuch"})
                await refused(404, "model", "POST", chat, json={**body, "model": "bob.r"})
                await refused(400, "model", "POST", chat, json={**body, "model": plain.run_id})
                await refused(400, "messages", "POST", chat, json={**body, "messages": []})
                await refused(400, "messages[0].role", "POST", chat, json={**body, "messages": [{"role": "robot",
                                                                                                 "content": "x"}]})
                await refused(400, "messages[0].content", "POST", chat, json={**body, "messages": [
                    {"role": "user", "content": 7}]})
                await refused(400, "messages[0].content[0]", "POST", chat, json={**body, "messages": [
                    {"role": "user", "content": [{"type": "image_url"}]}]})
                await refused(400, "messages[1].tool_call_id", "POST", chat, json={**body, "messages": [
                    *HELLO, {"role": "tool", "content": "408"}]})
                await refused(400, "messages[0].tool_calls", "POST", chat, json={**body, "messages": [
                    {"role": "user", "content": "x", "tool_calls": [{"id": "a", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]})
                await refused(400, "messages[0].colour", "POST", chat, json={**body, "messages": [
                    {"role": "user", "content": "x", "colour": "red"}]})
                await refused(400, "messages", "POST", chat, json={**body, "messages": [
                    {"role": "user", "content": "9" * 5000}]})
                assert results[-1][2]["error"]["code"] == "context_length_exceeded"  # OpenAI's, for agent loops
                await refused(400, "tools[0].type", "POST", chat, json={**body, "tools": [{"type": "retrieval"}]})
                await refused(400, "tools[0].function.name", "POST", chat, json={**body, "tools": [
                    {"type": "function", "function": {"name": "no spaces"}}]})
                await refused(400, "tools[0].function.parameters", "POST", chat, json={**body, "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]})
                await refused(400, "tools", "POST", chat, json={**body, "model": template.run_id, "tools": TOOLS})
                await refused(400, "tool_choice", "POST", chat, json={**body, "tool_choice": "required"})
                await refused(400, "max_tokens", "POST", chat, json={**body, "max_tokens": 10**6})
                await refused(400, "max_tokens", "POST", chat, json={**body, "max_tokens": 0})
                await refused(400, "temperature", "POST", chat, json={**body, "temperature": 9})
                await refused(400, "temperature", "POST", chat, json={**body, "temperature": "hot"})
                await refused(400, "n", "POST", f"{episode}/chat/completions", json={**body, "n": 2})
                await refused(400, "top_logprobs", "POST", chat, json={**body, "logprobs": True, "top_logprobs": 5})
                await refused(400, "logit_bias", "POST", chat, json={**body, "logit_bias": {"5": 10}})
                await refused(400, "presence_penalty", "POST", chat, json={**body, "presence_penalty": 1.5})
                await refused(400, "response_format", "POST", chat, json={**body, "response_format":
                                                                         {"type": "json_object"}})
                await refused(400, "stream_options", "POST", chat, json={**body, "stream_options":
                                                                        {"include_usage": True}})
                await refused(400, "stop", "POST", chat, json={**body, "stop": ["a", "b", "c", "d", "e"]})
                await refused(400, None, "POST", chat, content=b"{not json")
                await refused(400, "prompt", "POST", f"{url}/completions", json={"model": model, "prompt": ["a", "b"]})
                await refused(400, "prompt", "POST", f"{url}/completions", json={"model": model,
                                                                                  "prompt": [10**6]})
                await refused(400, "logprobs", "POST", f"{url}/completions", json={"model": model, "prompt": "x",
                                                                                    "logprobs": 3})
                await refused(400, "echo", "POST", f"{url}/completions", json={"model": model, "prompt": "x",
                                                                                "echo": True})
                await refused(400, "wait_s", "GET", f"{url}/episodes/next", params={"model": model, "wait_s": "-1"})
                await refused(400, "task_id", "POST", f"{url}/episodes", json={"model": model, "task_id": "mine"})
                await refused(404, "episode_id", "POST", f"{url}/episodes/ep-nonesuch/reward", json={"reward": 1})
                await refused(404, "episode_id", "POST", f"{url}/episodes/ep-nonesuch/chat/completions", json=body)
                await refused(400, "reward", "POST", f"{episode}/reward", content=b'{"reward": NaN}')
                await refused(400, "reward", "POST", f"{episode}/reward", content=b'{"reward": Infinity}')
                await refused(400, "reward", "POST", f"{episode}/reward", json={"reward": "1"})
                await refused(400, "reward", "POST", f"{episode}/reward", json={})  # no call, nothing to score
                await refused(400, "points", "POST", f"{episode}/reward", json={"points": 1})
                ok = await http.post(f"{episode}/reward", json={"reward": 0.5})
                assert ok.status_code == 200 and ok.json()["reward"] == 0.5, ok.text
                await refused(400, "episode_id", "POST", f"{episode}/reward", json={"reward": 1})
                await refused(400, "episode_id", "POST", f"{episode}/chat/completions", json=body)
                # Without a key: 401 in the same shape.
                resp = await httpx.AsyncClient().post(chat, json=body)
                assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
            return results

    results = asyncio.run(scenario())
    assert all(status < 500 for _, status, _ in results)


def test_tools_in_a_system_message_read_as_the_tool_use_environment_writes_them():
    for fmt in ("hermes", "llama3"):
        assert declaration([SCHEMAS["calculator"]], fmt) == _system_prompt(["calculator"], fmt)

