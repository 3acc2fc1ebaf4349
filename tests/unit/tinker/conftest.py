"""A Tinker endpoint for the official `tinker` SDK, without Ray: the gateway's real HTTP listener
(`start_http`) with the Tinker API (its operations in process, models' runs in memory: `LocalRuns`) over the
learner's real session table (an in-process worker group: the
`tiny-chat` preset on CPU, gloo, one rank) and the real transformers rollout engine, in a thread of its own
(the SDK blocks its caller). Two users hold `tml-` keys from the users file (`add_user(..., tinker=True)`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from rlserve.gateway.http import HttpConfig, start_http
from rlserve.learner.in_process_group import InProcessWorkerGroup
from rlserve.learner.sessions import SessionTable
from rlserve.models import resolve_model
from rlserve.rollout.hf_engine import TransformersEngine
from rlserve.rollout.interfaces import EngineConfig
from rlserve.security.identity import TokenStore
from rlserve.security.principal import Role
from rlserve.security.users import add_user
from rlserve.tenancy.policy import CallerLimits
from rlserve.tinker.api import TinkerApi
from rlserve.tinker.calls import TinkerCalls
from rlserve.tinker.local import EngineSampler, LocalRuns, TableTrainer
from rlserve.tinker.service import TinkerConfig, TinkerService
from tests.unit.learner.conftest import KeptPublishing

BASE = "rlserve/tiny-chat"


@dataclass
class Endpoint:
    url: str
    keys: dict[str, str]
    service: TinkerService
    sampler: EngineSampler
    runs: LocalRuns
    loop: asyncio.AbstractEventLoop

    def run(self, coro):
        """`coro` on the server's loop (a test's direct look at the service)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)


@pytest.fixture(scope="package")
def endpoint(tmp_path_factory) -> Iterator[Endpoint]:
    tmp = tmp_path_factory.mktemp("tinker")
    users = tmp / "users"
    keys = {name: add_user(users, name, admin=False, tinker=True) for name in ("alice", "bob")}
    token_files = {}
    for role in (Role.USER, Role.ADMIN):
        token_files[role] = tmp / f"{role.name.lower()}.token"
        token_files[role].write_text(f"{role.name.lower()}-" + "0" * 40 + "\n")
        token_files[role].chmod(0o600)
    model = resolve_model("preset:tiny-chat")
    loop = asyncio.new_event_loop()
    started: dict = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            table = SessionTable(InProcessWorkerGroup.starter(KeptPublishing()))
            engine = TransformersEngine(EngineConfig(model_path=model, device="cpu", enable_lora=True, max_loras=2))
            sampler = EngineSampler(engine, max_adapters=2)
            runs = LocalRuns()
            service = TinkerService(TinkerConfig(bases={BASE: "preset:tiny-chat"}), tmp / "runs",
                                    TableTrainer(table), sampler, runs)
            runner = await start_http(HttpConfig("127.0.0.1", 0, TokenStore(token_files, users),
                                                 CallerLimits()), [TinkerApi(TinkerCalls(service, poll_s=2.0))])
            started.update(port=runner.addresses[0][1], service=service, sampler=sampler, runs=runs, runner=runner)

        loop.run_until_complete(start())
        started["ready"].set()
        loop.run_forever()

    started["ready"] = threading.Event()
    thread = threading.Thread(target=serve, daemon=True, name="tinker-endpoint")
    thread.start()
    assert started["ready"].wait(300)
    yield Endpoint(f"http://127.0.0.1:{started['port']}", keys, started["service"], started["sampler"],
                   started["runs"], loop)
    asyncio.run_coroutine_threadsafe(started["runner"].cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    if dist.is_initialized():
        dist.destroy_process_group()


def model_path() -> Path:
    return resolve_model("preset:tiny-chat")
