"""The example agent (examples/agents/calculator_agent.py, the `openai` client only) plays a run to its end
over the real listener, its spec validates, and its calculator answers only arithmetic."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from rlserve.config import load_spec
from tests.unit.agents.conftest import drive

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agents"


def _agent_module():
    spec = importlib.util.spec_from_file_location("calculator_agent", EXAMPLE / "calculator_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_spec_validates():
    spec = load_spec(EXAMPLE / "grpo_calculator_agent.yaml")
    assert spec.env.external_agent and spec.sft.enabled and spec.data.task == "tool_multiplication"


def test_the_example_agent_plays_a_run_to_its_end(endpoint):
    agent = _agent_module()
    assert agent.calculate("123*45") == "5535" and agent.calculate("__import__('os')").startswith("error")

    async def scenario():
        async with endpoint() as ep:
            run = ep.run(env={"enabled": True, "name": "external_agent", "args": {"declare_tools": "none"}},
                         grpo={"max_num_steps": 1, "val_period": 0, "val_at_start": False})
            loop = asyncio.create_task(drive(run, ep.services))
            client = agent.OpenAI(base_url=ep.url, api_key=ep.keys["alice"], max_retries=0)

            def play_all() -> int:
                played = 0
                while agent.play(client, run.run_id):
                    played += 1
                return played

            played = await asyncio.gather(*(asyncio.to_thread(play_all) for _ in range(2)))
            await loop
            return run, played, ep.services

    run, played, services = asyncio.run(scenario())
    assert run.ledger.balanced() and run.ledger.trained > 0, run.error
    assert sum(played) >= 4
    prompts = [services.tok.tok.decode(p) for p, _ in services.answers]
    assert not any("<tools>" in p for p in prompts)  # declare_tools: none
    assert any("<tool_response>\n" in p for p in prompts)  # the calculator's answers, in the Hermes format
