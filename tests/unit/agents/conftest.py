"""The agent endpoint over the wire without a cluster: the real HTTP listener (`gateway.http`) with the real
OpenAI API, hub and sessions, over the in-memory services (`tests/support/fake_services.py`) whose
generation here is scripted: a calculator-calling model of the `tiny-chat` preset's tokenizer (a fake
only of the engine's sampling, which needs no cluster to be real elsewhere: tests/integration/test_agents.py)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlserve.agents.hub import AgentHub
from rlserve.agents.openai_api import OpenAiApi
from rlserve.config import RunSpec, spec_to_yaml
from rlserve.data.prompts import PromptTokenizer
from rlserve.gateway.http import HttpConfig, start_http
from rlserve.loop.inputs import LoopSettings
from rlserve.loop.recovery import run_to_end
from rlserve.rpc import not_found
from rlserve.runs.record import Run
from rlserve.security.identity import TokenStore
from rlserve.security.principal import Principal, Role
from rlserve.security.users import add_user
from rlserve.tenancy.policy import CallerLimits
from rlserve.v1 import common_pb2, rollout_pb2
from tests.support.fake_services import FakeServices
from tests.unit.conftest import SMALL, merged

SETTINGS = LoopSettings(weight_store="fake", watchdog_timeout_s=60)
# A run of the calculator task with tools declared in a system message (tiny-chat's template renders none).
AGENT = {"policy": {"model_name": "preset:tiny-chat", "max_total_sequence_length": 1024,
                    "generation": {"max_new_tokens": 128}},
         "data": {"task": "tool_multiplication", "task_args": {"use_tool": False}, "prompt_format": "chat",
                  "num_train": 64, "num_val": 4},
         "env": {"enabled": True, "name": "external_agent", "timeout_s": 20},
         "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 2,
                  "val_period": 2, "max_val_samples": 2},
         "reward": {"functions": [{"name": "exact_match"}]}}
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_PRODUCT = re.compile(r"(\d+)\*(\d+)")


class Calculating(FakeServices):
    """Generation that calls the calculator on the prompt's product, then answers what the tool said (wrong
    every other time, so groups differ); every answer it gave is kept for the tests."""

    def __init__(self, tok: PromptTokenizer, **kw):
        super().__init__(**kw)
        self.tok = tok
        self.answered = 0
        self.answers: list[tuple[list[int], rollout_pb2.Sample]] = []  # (prompt, sample) of every Generate

    def _text(self, prompt: list[int], k: int) -> str:
        text = self.tok.tok.decode(prompt)
        said = _RESPONSE.findall(text)
        if said:
            self.answered += 1
            return said[-1] if self.answered % 2 else said[-1] + "1"
        product = _PRODUCT.findall(text)
        a, b = product[-1] if product else ("2", "3")
        return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + f"{a}*{b}" + '"}}\n</tool_call>'

    async def generate(self, req: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        self.calls.generate.append(req)
        prompt = list(req.prompts[0].token_ids.ids)
        samples = []
        for k in range(req.num_samples or 1):
            text = self._text(prompt, k)
            ids = (self.tok.encode(text) + [self.tok.eos_ids[0]])[:req.sampling.max_new_tokens]
            finish = common_pb2.FINISH_REASON_STOP if len(ids) < req.sampling.max_new_tokens or ids[-1] in \
                self.tok.eos_ids else common_pb2.FINISH_REASON_LENGTH
            sample = rollout_pb2.Sample(token_ids=ids, logprobs=[-0.25 - 0.01 * (i % 7) for i in range(len(ids))],
                                        finish_reason=finish, text=self.tok.tok.decode(ids, skip_special_tokens=True),
                                        version_runs=[rollout_pb2.VersionRun(version=self.served, start=0,
                                                                             end=len(ids))])
            samples.append(sample)
            self.answers.append((prompt, sample))
        return rollout_pb2.GenerateResponse(completions=[rollout_pb2.Completion(prompt_token_ids=prompt,
                                                                                 samples=samples)],
                                            weight_version=self.served, replica_id="fake", engine_seconds=0.001)


@dataclass
class LocalBackend:
    """The endpoint's `Backend` in one process: the hub over runs in a dict (the gateway's is Serve handles)."""

    hub: AgentHub
    runs: dict[str, Run] = field(default_factory=dict)

    def find(self, run_id: str, caller: Principal) -> Run:
        run = self.runs.get(run_id)
        if run is None or not caller.may_access(run.owner):
            raise not_found(f"run {run_id!r}")
        return run

    async def list_runs(self, caller):
        return [r.to_proto() for r in self.runs.values() if caller.may_access(r.owner)]

    async def next_episode(self, req, caller):
        return await self.hub.next_episode(req, caller)

    async def start_episode(self, req, caller):
        return await self.hub.start_episode(req, caller)

    async def chat(self, req, caller):
        return await self.hub.chat(req, caller)

    async def end_episode(self, req, caller):
        return await self.hub.end_episode(req, caller)


@dataclass
class Endpoint:
    url: str  # .../v1
    keys: dict[str, str]  # user name -> token
    backend: LocalBackend
    services: Calculating
    root: Path

    def services_of_another_learner(self) -> Calculating:
        """Services for a second run at once (the fake learner holds one session), with the same agents' table."""
        other = Calculating(self.services.tok)
        other.agents = self.services.agents
        return other

    def run(self, run_id: str = "r", owner: str = "alice", **over) -> Run:
        spec = RunSpec.model_validate(merged(merged(SMALL, AGENT), over))
        run_dir = self.root / run_id
        run_dir.mkdir()
        (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        run = Run(run_id, spec, run_dir, owner)
        self.backend.runs[run_id] = run
        return run


@pytest.fixture
def endpoint(tmp_path):
    """`async with endpoint() as ep`: the listener on a free port, users alice and bob (and admin), no run yet."""
    @asynccontextmanager
    async def start() -> AsyncIterator[Endpoint]:
        from rlserve.models import resolve_model

        tok = PromptTokenizer(resolve_model("preset:tiny-chat"), "chat", None)
        files = {}
        for role in (Role.USER, Role.ADMIN):
            files[role] = tmp_path / f"{role.name.lower()}.token"
            files[role].write_text(("u" if role == Role.USER else "a") * 40 + "\n")
            files[role].chmod(0o600)
        users = tmp_path / "users"
        keys = {name: add_user(users, name, admin=False) for name in ("alice", "bob")}
        services = Calculating(tok)
        backend = LocalBackend(AgentHub(services.agent_sessions(), lambda run_id, caller: backend.find(run_id, caller)))
        runner = await start_http(HttpConfig("127.0.0.1", 0, TokenStore(files, users), CallerLimits()),
                                  [OpenAiApi(backend)])
        port = runner.addresses[0][1]
        (tmp_path / "runs").mkdir()
        try:
            yield Endpoint(f"http://127.0.0.1:{port}/v1", keys, backend, services, tmp_path / "runs")
        finally:
            await runner.cleanup()

    return start


async def drive(run: Run, services: FakeServices) -> None:
    """The run to its end as the coordinator drives it: the loop, then the run's final state (which tells its
    agents it ended) and its session closed."""
    from rlserve.v1 import coordinator_pb2 as pb

    try:
        await run_to_end(run, services, SETTINGS)
    except Exception as err:
        run.end(pb.RUN_STATE_FAILED, str(err), reason="failed")
        raise
    else:
        run.end(pb.RUN_STATE_SUCCEEDED)
    finally:
        services.agent_sessions().close(run.run_id)


def calculate(expression: str) -> str:
    a, b = expression.split("*")
    return str(int(a) * int(b))


async def calculator_agent(url: str, key: str, model: str, rewrite: bool = False) -> int:
    """The agent of the tests: plays the run's episodes until the run ends, with the OpenAI client: a call with
    the tools, the calculator's answer as a tool message, a call for the answer, its own reward. With
    `rewrite` it replaces the tool exchange by a summary before the second call (a rewritten history).
    Returns the episodes it played."""
    import httpx
    from openai import AsyncOpenAI

    played = 0
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        while True:
            resp = await http.get(f"{url}/episodes/next", params={"model": model, "wait_s": 0.5})
            if resp.status_code != 200:
                assert "has ended" in resp.json()["error"]["message"], resp.text
                return played
            ep = resp.json()
            if ep["episode_id"] is None:
                continue
            async with AsyncOpenAI(base_url=ep["base_url"], api_key=key, max_retries=0) as client:
                messages = list(ep["messages"])
                first = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
                call = first.choices[0].message.tool_calls[0]
                answer = calculate(json.loads(call.function.arguments)["expression"])
                if rewrite:
                    messages.append({"role": "user", "content": f"The calculator says {answer}. Answer with it."})
                else:
                    messages += [first.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": call.id, "content": answer}]
                final = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            content = final.choices[0].message.content or ""
            # After a summary the fake model calls the tool again: the agent rewards every other episode then.
            reward = float(played % 2) if rewrite else float(content.strip() == ep["answer"])
            done = await http.post(f"{url}/episodes/{ep['episode_id']}/reward", json={"reward": reward})
            assert done.status_code == 200, done.text
            played += 1
