"""A session whose heartbeats stop ends with its models (their learner sessions are released), and the
users file issues keys of the SDK's form. The trainer here only records what it is asked (the session
policy is the service's; the learner's side is tests/unit/learner/test_primitives.py)."""

from __future__ import annotations

import asyncio

from tinker.lib._auth_token_provider import ApiKeyAuthProvider

from rlserve.security.principal import Principal, Role
from rlserve.security.users import add_user, read_users
from rlserve.tinker.local import LocalRuns
from rlserve.tinker.service import TinkerConfig, TinkerService

ALICE = Principal("alice", Role.USER)


class Recording:
    def __init__(self):
        self.released: list[str] = []

    async def configure(self, run_id, spec, base, init_adapter):
        return 1

    async def release(self, run_id):
        self.released.append(run_id)


def test_a_session_whose_heartbeats_stop_ends_with_its_models(tmp_path):
    async def main():
        trainer = Recording()
        service = TinkerService(TinkerConfig(bases={"b": "preset:tiny"}, heartbeat_timeout_s=0.4), tmp_path,
                                trainer, sampler=None, runs=LocalRuns())
        sid = service.create_session("alice")
        future = service.create_model(ALICE, {"session_id": sid, "model_seq_id": 0, "base_model": "b",
                                                "lora_config": {"rank": 4}})
        await future.task
        assert future.error is None and list(service.models) == [f"{sid}:train:0"]
        kept = service.create_session("alice")
        for _ in range(8):
            await asyncio.sleep(0.1)
            service.heartbeat("alice", kept)
        assert service.models == {} and trainer.released == [f"alice.tinker-{sid}-train-0"]
        assert not service.heartbeat("alice", sid) and service.heartbeat("alice", kept)
        assert not service.heartbeat("bob", kept)  # another user's session is no session

    asyncio.run(main())


def test_deploy_serve_issues_keys_the_sdk_accepts(tmp_path):
    key = add_user(tmp_path / "users", "carol", admin=False, tinker=True)
    assert ApiKeyAuthProvider(key).api_key == key and key.startswith("tml-")
    assert [u.principal.name for u in read_users(tmp_path / "users")] == ["carol"]
