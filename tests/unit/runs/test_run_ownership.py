"""The run manager with several users, without a cluster: runs belong to their submitters (also after a
restart), another user's run answers exactly like a missing one, run ids are per user, a spec names
only its user's run folders, and per-user quotas (`tenancy`) answer RESOURCE_EXHAUSTED naming the limit."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import yaml

from rlserve.rpc import RpcError
from rlserve.runs.manager import Admission, RunManager
from rlserve.runs.record import TERMINAL
from rlserve.security.paths import PathPolicy
from rlserve.security.principal import SYSTEM, Principal, Role
from rlserve.tenancy.live import LiveTenancy
from rlserve.tenancy.policy import TenancyPolicy, samples_of
from rlserve.v1 import coordinator_pb2 as pb

SPEC = yaml.safe_dump({"name": "unit", "grpo": {"max_num_steps": 2, "num_prompts_per_step": 4,
                                                 "num_generations_per_prompt": 2},
                       "logger": {"tensorboard_enabled": False}})
ALICE, BOB = Principal("alice", Role.USER), Principal("bob", Role.USER)
ROOT = Principal("root", Role.ADMIN)


class ConfinedModels(Admission):
    """Confines `policy.model_name` like RunAdmission does (models or the caller's own runs); preflights
    wait until `go` is set."""

    def __init__(self, runs_dir, models_dir):
        self.paths = PathPolicy(runs_dir.resolve(), (models_dir.resolve(),))
        self.go = asyncio.Event()
        self.go.set()

    async def check(self, spec, run_access):
        spec = spec.model_copy(deep=True)
        spec.policy.model_name = self.paths.for_runs(run_access).model_name("spec_yaml: policy.model_name",
                                                                            spec.policy.model_name)
        return spec

    async def preflight(self, spec):
        await self.go.wait()


class Held:
    """A run body that holds every run until `release` is set."""

    def __init__(self):
        self.release = asyncio.Event()

    async def __call__(self, run):
        await self.release.wait()
        run.record_step(run.spec.max_num_steps, 0, {"batch/trajectories_trained": 0.0})


def manager(tmp_path, body=None, tenancy: dict | None = None) -> RunManager:
    (tmp_path / "models").mkdir(exist_ok=True)
    runs = tmp_path / "runs"
    return RunManager(runs, body or Held(), ConfinedModels(runs, tmp_path / "models"), preflight_timeout_s=5,
                      tenancy=LiveTenancy(TenancyPolicy.model_validate(tenancy or {})))


async def until(predicate, what: str):
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def refused(code: grpc.StatusCode):
    class Catch:
        def __enter__(self):
            return self

        def __exit__(self, kind, err, tb):
            assert isinstance(err, RpcError) and err.code == code, err
            self.message = err.message
            return True
    return Catch()


def test_another_users_run_answers_exactly_like_a_run_that_does_not_exist(tmp_path):
    async def main():
        m = manager(tmp_path)
        run = await m.submit(SPEC, "exp", False, ALICE)
        assert run.run_id == "alice.exp" and run.owner == "alice" and run.to_proto().owner == "alice"
        for run_id in (run.run_id, "alice.nope"):
            with refused(grpc.StatusCode.NOT_FOUND) as theirs:
                m.get(run_id, BOB)
            with refused(grpc.StatusCode.NOT_FOUND) as cancel:
                m.cancel(run_id, BOB)
            with refused(grpc.StatusCode.NOT_FOUND) as resume:
                await m.submit("", run_id, True, BOB)
            assert theirs.message == cancel.message == resume.message == f"run {run_id!r}"
        assert m.list_protos(BOB) == [] and [r.run_id for r in m.list_protos(ALICE)] == ["alice.exp"]
        assert [(r.run_id, r.owner) for r in m.list_protos(ROOT)] == [("alice.exp", "alice")]
        assert m.get("alice.exp", ALICE).state != pb.RUN_STATE_CANCELLED, "bob's cancel reached nothing"
        m.cancel("alice.exp", ROOT)  # an admin acts on every run, and the run's events say who did
        assert any(ev.message == "CancelRun by root" for ev in m.get("alice.exp", ALICE).events)
        assert any(ev.message == "submitted by alice" for ev in m.get("alice.exp", ALICE).events)
    asyncio.run(main())


def test_run_ids_are_per_user_so_a_taken_id_tells_nothing_about_others(tmp_path):
    async def main():
        m = manager(tmp_path)
        a, b = await m.submit(SPEC, "exp", False, ALICE), await m.submit(SPEC, "exp", False, BOB)
        assert (a.run_id, b.run_id) == ("alice.exp", "bob.exp")
        assert (await m.submit(SPEC, "alice.two", False, ALICE)).run_id == "alice.two"  # already in its space
        assert (await m.submit(SPEC, "alice.x", False, BOB)).run_id == "bob.alice.x"
        with refused(grpc.StatusCode.ALREADY_EXISTS):
            await m.submit(SPEC, "exp", False, ALICE)
        assert (await m.submit(SPEC, "", False, BOB)).run_id.startswith("bob.unit-")
        assert (await m.submit(SPEC, "plain", False, SYSTEM)).run_id == "plain"  # the cluster's own calls
        with refused(grpc.StatusCode.INVALID_ARGUMENT) as err:
            await m.submit(SPEC, "x" * 125, False, ALICE)
        assert err.message.startswith("run_id:")
    asyncio.run(main())


def test_ownership_survives_a_restart_and_old_runs_belong_to_the_token_file_user(tmp_path):
    async def first():
        body = Held()
        body.release.set()
        m = manager(tmp_path, body)
        await m.submit(SPEC, "exp", False, ALICE)
        await m.submit(SPEC, "old", False, Principal("user", Role.USER))
        await until(lambda: all(r.state in TERMINAL for r in m.runs.values()), "runs end")
    asyncio.run(first())
    info = json.loads((tmp_path / "runs" / "alice.exp" / "run.json").read_text())
    assert info["owner"] == "alice"
    old = tmp_path / "runs" / "user.old" / "run.json"
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "owner"}))

    again = manager(tmp_path)
    assert again.get("alice.exp", ALICE).owner == "alice"
    with refused(grpc.StatusCode.NOT_FOUND):
        again.get("alice.exp", BOB)
    assert [r.run_id for r in again.list_protos(Principal("user", Role.USER))] == ["user.old"]
    assert {r.owner for r in again.list_protos(ROOT)} == {"alice", "user"}


def test_a_spec_names_only_its_own_users_run_folders(tmp_path):
    """policy.model_name (an init-from or warm start) into another user's run, into a run that does not
    exist, or into the cluster's state folder: one answer, naming the field; the caller's own run's folder
    is fine, and an admin may name any run."""
    async def main():
        m = manager(tmp_path)
        mine = await m.submit(SPEC, "exp", False, ALICE)
        await m.submit(SPEC, "exp", False, BOB)
        runs = tmp_path / "runs"
        (runs / ".cluster").mkdir()
        for owner in ("alice", "bob"):  # each run has a finished policy to start from
            (runs / f"{owner}.exp" / "final_model").mkdir()
            (runs / f"{owner}.exp" / "final_model" / "config.json").write_text("{}")
        for target in ("bob.exp/final_model", "nobody.exp/final_model", ".cluster", "bob.exp", ""):
            for value in (str(runs / target), f"{runs}/alice.exp/../{target}"):
                spec = SPEC.replace("name: unit", f"name: unit\npolicy: {{model_name: '{value}'}}")
                with refused(grpc.StatusCode.PERMISSION_DENIED) as err:
                    await m.submit(spec, "", False, ALICE)
                assert err.message.startswith("spec_yaml: policy.model_name: ")
                assert "bob.exp" not in err.message.replace(value, "") and "exists" not in err.message
        own = SPEC.replace("name: unit", f"name: unit\npolicy: {{model_name: '{mine.run_dir}/final_model'}}")
        assert (await m.submit(own, "", False, ALICE)).spec.policy.model_name == f"{mine.run_dir}/final_model"
        theirs = SPEC.replace("name: unit", f"name: unit\npolicy: {{model_name: '{runs}/bob.exp/final_model'}}")
        await m.submit(theirs, "", False, ROOT)
    asyncio.run(main())


def test_quota_on_unfinished_runs_just_under_and_just_over(tmp_path):
    async def main():
        body = Held()
        m = manager(tmp_path, body, {"default_user": {"max_unfinished_runs": 2, "max_waiting_runs": 5}})
        await m.submit(SPEC, "a", False, ALICE)
        await m.submit(SPEC, "b", False, ALICE)  # just under: 1 running or queued before it
        with refused(grpc.StatusCode.RESOURCE_EXHAUSTED) as err:
            await m.submit(SPEC, "c", False, ALICE)
        assert err.message.startswith("quota max_unfinished_runs (tenancy.default_user.max_unfinished_runs) is 2: "
                                      "2 of your runs are queued or running")
        await m.submit(SPEC, "c", False, BOB)  # other users have their own
        await m.submit(SPEC, "c", False, ROOT)  # admins without an entry are not limited
        await m.submit(SPEC, "d", False, ROOT)
        m.cancel("alice.a", ALICE)
        await until(lambda: m.get("alice.a", ALICE).state in TERMINAL, "a cancelled")
        await m.submit(SPEC, "c", False, ALICE)  # room again once one ended
        body.release.set()
    asyncio.run(main())


def test_quota_on_queued_runs_just_under_and_just_over(tmp_path):
    async def main():
        m = manager(tmp_path, Held(), {"default_user": {"max_waiting_runs": 3},
                                      "users": {"bob": {"max_waiting_runs": 1}}})
        m.admission.go.clear()  # preflights wait: every run stays queued
        await m.submit(SPEC, "1", False, BOB)
        with refused(grpc.StatusCode.RESOURCE_EXHAUSTED) as err:
            await m.submit(SPEC, "2", False, BOB)
        assert err.message.startswith("quota max_waiting_runs (tenancy.users.bob.max_waiting_runs) is 1: 1 of your "
                                      "runs are waiting to start")
        for i in range(3):
            await m.submit(SPEC, str(i), False, ALICE)
        with refused(grpc.StatusCode.RESOURCE_EXHAUSTED) as err:
            await m.submit(SPEC, "3", False, ALICE)
        assert "tenancy.default_user.max_waiting_runs" in err.message
    asyncio.run(main())


def test_quota_on_the_size_of_a_run_just_under_and_just_over(tmp_path):
    from rlserve.config import load_spec

    size, _ = samples_of(load_spec(SPEC))
    assert size == 2 * 4 * 2

    async def main():
        m = manager(tmp_path, Held(), {"users": {"alice": {"max_samples_per_run": size}}})
        await m.submit(SPEC, "fits", False, ALICE)
        bigger = SPEC.replace("max_num_steps: 2", "max_num_steps: 3")
        with refused(grpc.StatusCode.RESOURCE_EXHAUSTED) as err:
            await m.submit(bigger, "big", False, ALICE)
        assert err.message == (f"quota max_samples_per_run (tenancy.users.alice.max_samples_per_run) is {size}: "
                               f"spec_yaml: grpo.max_num_steps x grpo.num_prompts_per_step x "
                               f"grpo.num_generations_per_prompt = 3 x 4 x 2 = 24")
        assert not (tmp_path / "runs" / "alice.big").exists()
    asyncio.run(main())


def test_a_resume_counts_against_the_quotas_too(tmp_path):
    async def main():
        body = Held()
        body.release.set()
        m = manager(tmp_path, body, {"users": {"alice": {"max_samples_per_run": 16}}})
        await m.submit(SPEC, "r", False, ALICE)
        await until(lambda: m.get("alice.r", ALICE).state in TERMINAL, "r ends")
        with refused(grpc.StatusCode.RESOURCE_EXHAUSTED) as err:
            await m.submit(SPEC.replace("max_num_steps: 2", "max_num_steps: 3"), "alice.r", True, ALICE)
        assert "max_samples_per_run" in err.message
    asyncio.run(main())


def test_an_admin_with_an_entry_of_their_own_is_limited(tmp_path):
    async def main():
        m = manager(tmp_path, Held(), {"users": {"root": {"max_unfinished_runs": 1}}})
        await m.submit(SPEC, "a", False, ROOT)
        with refused(grpc.StatusCode.RESOURCE_EXHAUSTED) as err:
            await m.submit(SPEC, "b", False, ROOT)
        assert "tenancy.users.root.max_unfinished_runs" in err.message
        await m.submit(SPEC, "b", False, Principal("other", Role.ADMIN))
    asyncio.run(main())


@pytest.mark.parametrize("caller", [SYSTEM, Principal("admin", Role.ADMIN)])
def test_admins_see_and_name_every_run(tmp_path, caller):
    async def main():
        m = manager(tmp_path)
        await m.submit(SPEC, "exp", False, ALICE)
        assert m.get("alice.exp", caller).owner == "alice"
        assert [r.owner for r in m.list_protos(caller)] == ["alice"]
    asyncio.run(main())
