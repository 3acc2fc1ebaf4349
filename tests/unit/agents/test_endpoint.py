"""An external_agent run trained by agents written against the official `openai` client, over a real HTTP
listener: each episode's calls join one sequence in token space (the second call's prompt is the first
call's prompt and completion, then only the tool message rendered), a rewritten history starts another
sequence trained with the episode's reward and counted, the capture holds exactly what the engine
generated, streaming gives what the whole answer gives, and two users' agents play their own runs at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from rlserve.agents.capture import read
from rlserve.agents.session import session_for
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.inputs import RunInputs
from tests.unit.agents.conftest import TOOLS, calculator_agent, drive


def _trained_sequences(services) -> list[list[int]]:
    batch = services.calls.batches[0]
    return [batch.sequence(i).tolist() for i in range(batch.num_seqs)]


def test_a_tool_using_agent_trains_its_run_token_exactly(endpoint):
    async def scenario():
        async with endpoint() as ep:
            run = ep.run()
            loop = asyncio.create_task(drive(run, ep.services))
            played = await calculator_agent(ep.url, ep.keys["alice"], run.run_id)
            await loop
            return ep, run, played

    ep, run, played = asyncio.run(scenario())
    assert run.error == "" and run.step == 2 and run.ledger.balanced() and run.ledger.trained > 0, run.error
    # 2 steps x 2 prompts x 2 episodes, and 2 validations (at the start and at step 2) of 2 prompts.
    assert played == 2 * 2 * 2 + 2 * 2 and run.ledger.generated == 8
    rows = run.recorder.read("metrics.jsonl")
    assert rows[-1]["episode/env/calls"] == 2.0 and rows[-1]["episode/env/history_rewrites"] == 0.0
    assert rows[-1]["val/reward"] >= 0.0 and "timing/generate_s" in rows[-1]

    # The capture: every call, exactly as the engine answered it.
    calls = [r for r in read(run.run_dir) if r["kind"] == "call"]
    assert len(calls) == len(ep.services.answers) == 2 * played
    for call, (prompt, sample) in zip(calls, ep.services.answers):  # one agent: calls in the engine's order
        choice = call["choices"][0]
        assert call["prompt_token_ids"] == prompt and choice["token_ids"] == list(sample.token_ids)
        assert choice["logprobs"] == pytest.approx(list(sample.logprobs))
        assert choice["versions"] == [r.version for r in sample.version_runs for _ in range(r.start, r.end)]
    # Each episode's second call continued its first in token space: the first's prompt and completion, then
    # only the tool message and the generation prompt.
    by_episode: dict[str, list[dict]] = {}
    for call in calls:
        by_episode.setdefault(call["episode_id"], []).append(call)
    for first, second in by_episode.values():
        whole = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
        assert second["continued"] and second["prompt_token_ids"][:len(whole)] == whole
        assert second["sequence"] == first["sequence"] == 0 or first["validation"]
    # The learner's sequences are those: one per episode, the tool call and the answer in the loss.
    batch = ep.services.calls.batches[0]
    assert batch.num_seqs == 4 and batch.loss_mask is not None
    trained = {tuple(s) for s in _trained_sequences(ep.services)}
    assert any(tuple(c[0]["prompt_token_ids"] + c[0]["choices"][0]["token_ids"]
                     + c[1]["prompt_token_ids"][len(c[0]["prompt_token_ids"]) + len(c[0]["choices"][0]["token_ids"]):]
                     + c[1]["choices"][0]["token_ids"]) in trained for c in by_episode.values())


def test_an_agent_that_rewrites_its_history_trains_two_sequences_per_episode(endpoint):
    async def scenario():
        async with endpoint() as ep:
            run = ep.run(grpo={"max_num_steps": 1, "val_period": 0, "val_at_start": False},
                         loss_fn={"reference_policy_kl_penalty": 0.05})  # reference logprobs per sequence too
            loop = asyncio.create_task(drive(run, ep.services))
            await calculator_agent(ep.url, ep.keys["alice"], run.run_id, rewrite=True)
            await loop
            return ep, run

    ep, run = asyncio.run(scenario())
    assert run.step == 1 and run.ledger.balanced(), run.error
    rows = run.recorder.read("metrics.jsonl")
    assert rows[-1]["episode/env/history_rewrites"] == 1.0 and rows[-1]["episode/env/sequences"] == 2.0
    batch = ep.services.calls.batches[0]
    assert batch.num_seqs == 2 * 4  # each of the step's 4 episodes trains its two sequences
    advantages = batch.advantages.tolist()
    assert all(advantages[2 * k] == advantages[2 * k + 1] for k in range(4))  # one reward, one advantage
    calls = [r for r in read(run.run_dir) if r["kind"] == "call"]
    assert {c["sequence"] for c in calls} == {0, 1} and not any(c["continued"] for c in calls)
    assert ep.services.calls.reference == 1 and batch.ref_logprobs is not None


def test_an_episode_never_ended_is_abandoned_and_its_group_dropped(endpoint):
    async def scenario():
        async with endpoint() as ep:
            run = ep.run(env={"enabled": True, "name": "external_agent", "timeout_s": 1},
                         grpo={"max_num_steps": 1, "val_period": 0, "val_at_start": False})
            loop = asyncio.create_task(drive(run, ep.services))
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ep.keys['alice']}"}) as http:
                while True:  # the first episode handed out is forgotten by its agent
                    first = (await http.get(f"{ep.url}/episodes/next", params={"model": run.run_id,
                                                                               "wait_s": 1})).json()
                    if first["episode_id"]:
                        break
                await asyncio.sleep(1.5)
                late = await http.post(f"{first['base_url']}/reward", json={"reward": 1.0})
                await calculator_agent(ep.url, ep.keys["alice"], run.run_id)
            await loop
            return run, late

    run, late = asyncio.run(scenario())
    assert run.ledger.dropped["episode_abandoned"] == 2 and run.ledger.trained == 2 and run.ledger.balanced()
    assert late.status_code == 400 and late.json()["error"]["param"] == "episode_id"
    assert "abandoned" in late.json()["error"]["message"]


def test_streaming_gives_what_the_whole_answer_gives(endpoint):
    async def scenario():
        async with endpoint() as ep:
            run = ep.run()
            inputs = RunInputs.build(run.run_id, run.spec, run.run_dir, algorithm_class(run.spec).data)
            session_for(ep.services, inputs)
            client = AsyncOpenAI(base_url=ep.url, api_key=ep.keys["alice"], max_retries=0)
            messages = [{"role": "user", "content": "What is 12*34?"}]
            whole = await client.chat.completions.create(model=run.run_id, messages=messages, tools=TOOLS,
                                                         logprobs=True)
            stream = await client.chat.completions.create(model=run.run_id, messages=messages, tools=TOOLS,
                                                          stream=True, stream_options={"include_usage": True},
                                                          logprobs=True)
            chunks = [c async for c in stream]
            answer = await client.chat.completions.create(model=run.run_id, stream=True, messages=[
                *messages, whole.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": whole.choices[0].message.tool_calls[0].id, "content": "408"}])
            text = "".join([c.choices[0].delta.content or "" async for c in answer if c.choices])
            plain = await client.completions.create(model=run.run_id, prompt="12*34=", stream=True)
            plain_text = "".join([c.choices[0].text async for c in plain if c.choices])
            await client.close()
            return whole, chunks, text, plain_text

    whole, chunks, text, plain_text = asyncio.run(scenario())
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    streamed = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [("calculator", call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed_lps = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs
                    for lp in c.choices[0].logprobs.content]
    assert streamed_lps == [lp.logprob for lp in whole.choices[0].logprobs.content]
    assert text == "408" and plain_text


def test_two_users_play_their_own_runs_at_once_and_never_see_the_others(endpoint):
    async def scenario():
        async with endpoint() as ep:
            runs = {user: ep.run(f"{user}.r", user, grpo={"max_num_steps": 1, "val_period": 0,
                                                          "val_at_start": False}) for user in ("alice", "bob")}
            loops = [asyncio.create_task(drive(runs["alice"], ep.services)),
                     asyncio.create_task(drive(runs["bob"], ep.services_of_another_learner()))]
            played = await asyncio.gather(*(calculator_agent(ep.url, ep.keys[u], r.run_id) for u, r in runs.items()))
            await asyncio.gather(*loops)
            # Alice asking for Bob's run reads exactly like asking for a run that does not exist.
            client = AsyncOpenAI(base_url=ep.url, api_key=ep.keys["alice"], max_retries=0)
            errors = []
            for model in ("bob.r", "nobody.r"):
                try:
                    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
                except Exception as err:  # noqa: BLE001 - the error is what is compared
                    errors.append((err.status_code, err.body))
            listed = [m.id async for m in client.models.list()]
            await client.close()
            return runs, played, errors, listed

    runs, played, errors, listed = asyncio.run(scenario())
    assert played == [4, 4] and all(r.ledger.trained > 0 and r.ledger.balanced() for r in runs.values())
    for (status, body), model in zip(errors, ("bob.r", "nobody.r")):
        assert status == 404 and body["param"] == "model" and body["code"] == "model_not_found"
        assert body["message"].replace(model, "X") == errors[1][1]["message"].replace("nobody.r", "X")
    assert listed == ["alice.r"]
    callers = {r["caller"] for run in runs.values() for r in read(run.run_dir) if r["kind"] == "call"}
    assert callers == {"alice", "bob"}


def test_an_agent_that_brings_its_own_tasks_trains_them_in_groups(endpoint):
    async def scenario():
        async with endpoint() as ep:
            run = ep.run(env={"enabled": True, "name": "external_agent", "args": {"tasks": "agent"}},
                         grpo={"max_num_steps": 1, "val_period": 0, "val_at_start": False})
            loop = asyncio.create_task(drive(run, ep.services))
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ep.keys['alice']}"}) as http, \
                    AsyncOpenAI(base_url=ep.url, api_key=ep.keys["alice"], max_retries=0) as client:
                for k in range(4):  # two tasks of my own, two episodes each (the run's group size)
                    while True:
                        started = await http.post(f"{ep.url}/episodes", json={
                            "model": run.run_id, "task_id": f"mine-{k // 2}", "answer": "408"})
                        if started.status_code != 503:  # until the run's first play opened its session
                            break
                        await asyncio.sleep(0.1)
                    assert started.status_code == 200, started.text
                    episode = started.json()
                    await client.with_options(base_url=episode["base_url"]).chat.completions.create(
                        model=run.run_id, messages=[{"role": "user", "content": f"What is 12*3{k}?"}])
                    # Scored by the run's reward functions (the fake's: a function of the text, 0 and 0.5 here).
                    done = await http.post(f"{episode['base_url']}/reward", json={"answer": "y" if k % 2 else "x"})
                    assert done.status_code == 200 and done.json()["reward"] == k % 2 / 2, done.text
            await loop
            return run

    run = asyncio.run(scenario())
    assert run.ledger.trained == 4 and run.ledger.balanced(), run.error
    tasks = {r["task_id"] for r in read(run.run_dir) if r["kind"] == "call"}
    assert tasks == {"mine-0", "mine-1"}
