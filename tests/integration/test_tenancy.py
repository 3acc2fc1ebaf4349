"""Several users on the shared cluster, through the real gateway and coordinator: each user's runs are
theirs alone (another user's run id answers exactly like a missing one, on every run RPC and in every path
of a spec), quotas from the cluster file's `tenancy` section (edited while the cluster runs) answer
RESOURCE_EXHAUSTED just over their limits, a revoked user is refused within 2 s while their run goes on, and a restarted
coordinator knows every run's owner and the same quotas."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray
import yaml
from google.protobuf import text_format
from ray import serve

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.clients.credentials import Credentials
from rlserve.security.users import add_user, revoke_user
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import TERMINAL, events_until_end, spec, wait_for

# The cluster file re-read by the coordinator at most once a second.
RELOAD_S = 1.5
# Bob's quota in the `tenancy` section, carol's under the old key (still read, as its new key).
USERS = {"bob": {"max_waiting_runs": 1, "max_samples_per_run": 3 * 8 * 4}}
OLD_QUOTAS = {"users": {"carol": {"max_concurrent_runs": 1}}}
# Alice's run: long enough to be running through the whole scenario; cancelled at its end.
LONG = dict(grpo__max_num_steps=200, grpo__val_period=0, grpo__val_at_start=False, checkpointing__enabled=False,
            logger__plot_enabled=False)


class Tenants:
    def __init__(self, test_cluster):
        self.tc = test_cluster
        self.users_file = test_cluster.cluster.users_file
        self.tokens = {name: add_user(self.users_file, name, admin=False) for name in ("alice", "bob", "carol")}
        self.tokens["root"] = add_user(self.users_file, "root", admin=True)
        self.clients: dict[str, CoordinatorClient] = {}

    def client(self, name: str) -> CoordinatorClient:
        if name not in self.clients:
            self.clients[name] = CoordinatorClient(self.tc.endpoint, credentials=Credentials(self.tokens[name]))
        return self.clients[name]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


@pytest.fixture(scope="module")
def tenants(test_cluster):
    cluster_file = test_cluster.cluster_file
    original = cluster_file.read_text()
    data = yaml.safe_load(original)
    data.setdefault("tenancy", {})["users"] = USERS
    data["quotas"] = OLD_QUOTAS
    cluster_file.write_text(yaml.safe_dump(data))  # no redeploy: the coordinator re-reads it
    t = Tenants(test_cluster)
    time.sleep(RELOAD_S)  # the gateway re-reads the users file, the coordinator the quotas
    yield t
    for name in ("alice", "bob", "carol"):
        for run in t.client("root").list():
            if run.owner == name and run.state not in TERMINAL:
                t.client("root").cancel(run.run_id)
    t.close()
    cluster_file.write_text(original)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        out = fn()
        if hasattr(out, "__next__"):
            list(out)
    return err.value


def every_run_rpc(client: CoordinatorClient, run_id: str) -> dict[str, grpc.RpcError]:
    """Each run RPC a user can aim at one run id, and what it answered."""
    return {
        "GetRun": rpc_error(lambda: client.get(run_id)),
        "WatchRun": rpc_error(lambda: client.stub.WatchRun(pb.WatchRunRequest(run_id=run_id),
                                                           metadata=client.metadata, timeout=30)),
        "CancelRun": rpc_error(lambda: client.cancel(run_id)),
        "SubmitRun resume": rpc_error(lambda: client.submit("", run_id=run_id, resume=True)),
        "SubmitRun resume with a spec": rpc_error(lambda: client.submit(spec(grpo__max_num_steps=300), run_id=run_id,
                                                                        resume=True)),
    }


def text(message) -> str:
    return text_format.MessageToString(message)


def test_users_see_only_their_runs_quotas_hold_and_a_revoked_user_is_refused_while_their_run_goes_on(tenants):
    tc = tenants.tc
    alice, bob, carol, root = (tenants.client(n) for n in ("alice", "bob", "carol", "root"))
    secret = alice.submit(spec(**LONG), run_id="secret-run")
    assert secret.run_id == "alice.secret-run" and secret.owner == "alice"
    wait_for(alice, secret.run_id, pb.EVENT_KIND_STEP, timeout_s=300)
    # What bob may not learn about alice's run: its id, its folder, that alice owns something.
    markers = [f'"{secret.run_id}"', f'"{secret.run_dir}', 'owner: "alice"']
    seen_by_bob: list[str] = []

    # Every run RPC on alice's run answers exactly what it answers for a run that does not exist.
    missing_run = every_run_rpc(bob, "alice.no-such-run")
    for rpc, err in every_run_rpc(bob, secret.run_id).items():
        missing = missing_run[rpc]
        assert err.code() == missing.code() == grpc.StatusCode.NOT_FOUND, (rpc, err.details())
        assert err.details() == missing.details().replace("alice.no-such-run", secret.run_id), rpc
    seen_by_bob += [text(r) for r in bob.list()]
    assert alice.get(secret.run_id).state == pb.RUN_STATE_RUNNING, "bob's CancelRun reached nothing"

    # Every path of a spec into alice's run (or any run not bob's) is refused with one message.
    runs_dir = Path(secret.run_dir).parent
    (tc.models_dir / "alices-run").symlink_to(secret.run_dir)
    (tc.data_dir / "alices-events.jsonl").symlink_to(Path(secret.run_dir) / "events.jsonl")
    model_paths = [f"{secret.run_dir}/final_model", f"{secret.run_dir}/checkpoints/step_000002",
                   f"{secret.run_dir}/sft_model", secret.run_dir, f"{runs_dir}/alice.no-such-run/final_model",
                   f"{runs_dir}/.cluster", str(tc.models_dir / "alices-run" / "final_model")]
    answers = {}
    for value in model_paths:
        err = rpc_error(lambda: bob.submit(spec(policy__model_name=value)))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (value, err.details())
        assert err.details().startswith("spec_yaml: policy.model_name: "), err.details()
        answers[value] = err.details().replace(repr(value), "VALUE")
    assert len(set(answers.values())) == 1, answers  # whether that run exists, is alice's, or is none
    # A relative name through a link into alice's run answers like a name of nothing at all.
    link, nothing = (rpc_error(lambda: bob.submit(spec(policy__model_name=v))) for v in ("alices-run", "nothing"))
    assert (link.code(), link.details().replace("alices-run", "nothing")) == (nothing.code(), nothing.details())
    for value in (str(Path(secret.run_dir) / "events.jsonl"), "alices-events.jsonl"):
        err = rpc_error(lambda: bob.submit(spec(data__task="jsonl", data__train_path=value)))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and err.details().startswith(
            "spec_yaml: data.train_path: "), err.details()
    # The same id names bob's own run: a taken id tells nothing about other users.
    own = bob.submit(spec(grpo__max_num_steps=1), run_id=secret.run_id)
    assert own.run_id == "bob.alice.secret-run" and own.owner == "bob"
    bob.cancel(own.run_id)

    # Quotas (bob's and carol's entries, written into the cluster file while it ran), just under and over.
    over = rpc_error(lambda: bob.submit(spec(grpo__max_num_steps=4)))
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert over.details() == ("quota max_samples_per_run (tenancy.users.bob.max_samples_per_run) is 96: spec_yaml: "
                              "grpo.max_num_steps x grpo.num_prompts_per_step x grpo.num_generations_per_prompt "
                              "= 4 x 8 x 4 = 128")
    queued = bob.submit(spec(grpo__max_num_steps=3))  # exactly the size allowed; it waits behind alice's run
    seen_by_bob.append(text(queued))
    over = rpc_error(lambda: bob.submit(spec(grpo__max_num_steps=1)))
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and over.details().startswith(
        "quota max_waiting_runs (tenancy.users.bob.max_waiting_runs) is 1: 1 of your runs are waiting to start")
    first = carol.submit(spec(grpo__max_num_steps=1))
    over = rpc_error(lambda: carol.submit(spec(grpo__max_num_steps=1)))
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and over.details().startswith(
        "quota max_unfinished_runs (tenancy.users.carol.max_unfinished_runs) is 1: 1 of your runs are queued or "
        "running")
    for client, run in ((bob, queued), (carol, first)):
        assert client.cancel(run.run_id).state == pb.RUN_STATE_CANCELLED
    seen_by_bob += [text(ev) for ev in events_until_end(bob, queued.run_id, timeout_s=60)]
    seen_by_bob += [text(r) for r in bob.list()]
    assert {r.run_id for r in bob.list()} == {own.run_id, queued.run_id}
    leaks = [(m, s) for s in seen_by_bob for m in markers if m in s]
    assert not leaks, leaks
    assert not [s for s in seen_by_bob if "alice" in s and "bob.alice.secret-run" not in s]

    # Admins see every run and whose it is.
    owners = {r.run_id: r.owner for r in root.list()}
    assert owners[secret.run_id] == "alice" and owners[queued.run_id] == "bob" and owners[first.run_id] == "carol"

    # Revoked: alice's token is refused within 2 s; her run goes on; bob never notices.
    revoke_user(tenants.users_file, "alice")
    revoked = time.time()
    while True:
        try:
            alice.list()
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            break
        assert time.time() - revoked < 2.0, "a revoked token must be refused within 2 s"
        time.sleep(0.05)
    print(f"\nrevoke: refused after {time.time() - revoked:.2f}s")
    bob.list()
    step = wait_for(root, secret.run_id, pb.EVENT_KIND_STEP, where=lambda ev: ev.time_unix > revoked + 0.5)
    assert root.get(secret.run_id).state == pb.RUN_STATE_RUNNING, "the revoked user's run goes on"
    # A new token for the name gives alice her runs back.
    tenants.tokens["alice"] = add_user(tenants.users_file, "alice", admin=False)
    tenants.clients.pop("alice").close()
    time.sleep(RELOAD_S)
    assert tenants.client("alice").get(secret.run_id).step >= step.step
    assert tenants.client("alice").cancel(secret.run_id).state in (pb.RUN_STATE_CANCELLING, pb.RUN_STATE_CANCELLED)
    events_until_end(tenants.client("alice"), secret.run_id, timeout_s=120)
    assert tenants.client("alice").get(secret.run_id).state == pb.RUN_STATE_CANCELLED


def _coordinator_replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::coordinator#")]


def test_a_restarted_coordinator_knows_every_owner_and_the_same_quotas(tenants, ray_driver):
    alice, bob, root = (tenants.client(n) for n in ("alice", "bob", "root"))
    for run in root.list():  # what an earlier test left running
        if run.owner in tenants.tokens and run.state not in TERMINAL:
            root.cancel(run.run_id)
            events_until_end(root, run.run_id, timeout_s=120)
    mine = alice.submit(spec(grpo__max_num_steps=1), run_id="before-restart")
    alice.cancel(mine.run_id)
    events_until_end(alice, mine.run_id, timeout_s=120)
    before = {r.run_id: r.owner for r in root.list()}
    assert before[mine.run_id] == "alice"
    hidden = rpc_error(lambda: bob.get(mine.run_id)).details()
    over = rpc_error(lambda: bob.submit(spec(grpo__max_num_steps=4))).details()
    assert all(r.state in TERMINAL for r in root.list()), "nothing may run while the coordinator restarts"

    victims = _coordinator_replicas()
    assert len(victims) == 1, victims
    ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
    deadline = time.time() + 240
    while True:
        assert time.time() < deadline, f"the coordinator did not come back: {serve.status().applications}"
        replicas = _coordinator_replicas()
        if replicas and replicas != victims and serve.status().applications["coordinator"].status == "RUNNING":
            try:
                after = {r.run_id: r.owner for r in root.list()}
                break
            except grpc.RpcError:
                pass
        time.sleep(1)

    assert after == before
    assert alice.get(mine.run_id).owner == "alice"
    assert mine.run_id not in {r.run_id for r in bob.list()}
    err = rpc_error(lambda: bob.get(mine.run_id))
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == hidden
    err = rpc_error(lambda: bob.submit(spec(grpo__max_num_steps=4)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == over


def test_a_user_flooding_the_spec_reader_delays_another_users_spec_by_about_one_reading(tenants):
    """Specs are read one of each waiting user in turn (`rlserve.runs.spec_reader`): while 24 of one user's
    specs at the parser's bounds (~30 ms each) wait, another user's is read next, and every spec is read."""
    mallory = CoordinatorClient(tenants.tc.endpoint, credentials=Credentials(
        add_user(tenants.users_file, "mallory", admin=False)))
    time.sleep(RELOAD_S)
    slow = "a: [" + ",".join(["1"] * 120_000) + "]"
    answered: list[str] = []

    def submit(client: CoordinatorClient, who: str, text: str) -> grpc.RpcError:
        err = rpc_error(lambda: client.submit(text))
        answered.append(who)
        return err
    try:
        with ThreadPoolExecutor(25) as pool:
            flood = [pool.submit(submit, mallory, "mallory", slow) for _ in range(24)]
            deadline = time.monotonic() + 60
            while not answered and time.monotonic() < deadline:  # the flood is at the reader
                time.sleep(0.005)
            alice = submit(tenants.client("alice"), "alice", "grpo: {max_num_steps: true}")
            errors = [f.result() for f in flood]
    finally:
        mallory.close()
    assert alice.code() == grpc.StatusCode.INVALID_ARGUMENT and "grpo.max_num_steps" in alice.details()
    assert answered.index("alice") <= 12, answered
    assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than 20000 values" in e.details()
               for e in errors), {e.details()[:80] for e in errors}
