"""The gateway's gRPC server on a real port, without Ray: tokens and roles are checked before any
forwarding code runs, every forwarded call carries its caller's principal, internal RPCs are absent
unless exposed, bad bytes and unknown methods get their own statuses, failures read as one clean
line, tokens rotate and users are revoked without a restart, limits are per user, TLS works.

The forwarder here answers in-process (the Serve handles are exercised by the integration tests
on the real cluster); it counts its calls, so a test can show that a refused call reached nothing.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.gateway import server
from rlserve.gateway.run_table import RunTable
from rlserve.rpc import not_found
from rlserve.runs.feed import FeedBatch
from rlserve.security.certs import self_signed
from rlserve.security.identity import TokenStore
from rlserve.security.principal import Principal, Role
from rlserve.security.tokens import new_token
from rlserve.security.users import add_user, revoke_user
from rlserve.tenancy.policy import CallerLimits
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import coordinator_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.support.dist import free_port


def _write(path: Path, *tokens: str) -> None:
    path.write_text("".join(t + "\n" for t in tokens))
    os.chmod(path, 0o600)


class Gateway:
    """A gateway server on its own event loop thread, with a counting in-process forwarder."""

    def __init__(self, tmp_path: Path, expose_internal: bool = False, tls: bool = False, auth: bool = True,
                 limits: CallerLimits = CallerLimits(), read_cache_ms: int = 0):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.user, self.admin = new_token(), new_token()
        self.user_file, self.admin_file = tmp_path / "token", tmp_path / "admin_token"
        self.users_file = tmp_path / "users"  # none yet: tests add users with `add_user`
        _write(self.user_file, self.user)
        _write(self.admin_file, self.admin)
        tokens = (TokenStore({Role.USER: self.user_file, Role.ADMIN: self.admin_file}, self.users_file) if auth
                  else None)
        self.cert = self.key = None
        if tls:
            self.cert, self.key = self_signed(tmp_path / "tls")
        self.port = free_port()
        self.calls: list[str] = []
        self.callers: list[Principal | None] = []  # the principal each forwarded call carried
        self.watched_from: list[int] = []  # the `from_sequence` of each forwarded WatchRun
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = server.GatewayConfig(host="127.0.0.1", port=self.port, tokens=tokens, expose_internal=expose_internal,
                                   limits=limits, read_cache_ms=read_cache_ms,
                                   apps={}, cert_file=self.cert, key_file=self.key)
        self.table = RunTable()  # never fed here: every read is forwarded unless a test feeds it
        self.server = self._run(server.start(cfg, self._forward, self._forward_stream, self.table))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _forward(self, method, request, caller):
        self.calls.append(method.name)
        self.callers.append(caller)
        if method.name == "GetRun":
            if request.run_id == "missing":
                raise not_found("run 'missing'")
            if request.run_id == "boom":
                raise RuntimeError("\x1b[31mboom\x1b[39m\nTraceback (most recent call last):\n  File ...")
            return pb.GetRunResponse(run=pb.Run(run_id=request.run_id))
        if method.name == "GetInfo":
            return rollout_pb2.GetInfoResponse(engine="in-process")
        return method.response()

    async def _forward_stream(self, method, request, caller):
        self.calls.append(method.name)
        self.callers.append(caller)
        self.watched_from.append(request.from_sequence)
        if request.from_sequence == 10**12:  # an idle watcher: the stream stays open, sending nothing
            await asyncio.sleep(3600)
        for i in range(request.from_sequence, request.from_sequence + 3):
            yield pb.WatchRunResponse(event=pb.RunEvent(sequence=i, run_id=request.run_id, time_unix=time.time()))

    def channel(self, token: str | None = None, secure: bool = False) -> tuple[grpc.Channel, tuple]:
        target = f"127.0.0.1:{self.port}"
        ch = (grpc.secure_channel(target, grpc.ssl_channel_credentials(self.cert.read_bytes())) if secure
              else grpc.insecure_channel(target))
        return ch, (("authorization", f"Bearer {token}"),) if token else ()

    def close(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def gateway(tmp_path):
    made = []

    def make(**kwargs) -> Gateway:
        made.append(Gateway(tmp_path / str(len(made)), **kwargs))
        return made[-1]
    yield make
    for g in made:
        g.close()


def _code(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_tokens_decide_before_anything_is_forwarded(gateway):
    g = gateway()
    ch, _ = g.channel()
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    for md in ((), (("authorization", "Bearer " + "x" * 43),), (("authorization", g.user),),
               (("authorization", "Basic " + g.user),)):
        err = _code(lambda: stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=md))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "deploy/serve token" in err.details()
    assert g.calls == [], "a refused call must not reach the service"
    for token in (g.user, g.admin):
        assert stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=(("authorization", f"Bearer {token}"),)
                           ).run.run_id == "r"
    assert g.calls == ["GetRun", "GetRun"]


def test_internal_rpcs_are_absent_unless_exposed_and_then_admin_only(gateway):
    hidden = gateway()
    ch, user = hidden.channel(hidden.user)
    _, admin = hidden.channel(hidden.admin)
    stub = rollout_pb2_grpc.RolloutStub(ch)
    for md in (user, admin):
        assert _code(lambda: stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=md)).code() == \
            grpc.StatusCode.UNIMPLEMENTED
    exposed = gateway(expose_internal=True)
    ch, user = exposed.channel(exposed.user)
    _, admin = exposed.channel(exposed.admin)
    stub = rollout_pb2_grpc.RolloutStub(ch)
    err = _code(lambda: stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=user))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
    assert stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=admin).engine == "in-process"
    assert exposed.calls == ["GetInfo"] and hidden.calls == []


def test_bad_bytes_unknown_methods_and_failures_get_meaningful_statuses(gateway):
    g = gateway()
    ch, md = g.channel(g.user)
    raw = ch.unary_unary("/rlserve.v1.Coordinator/GetRun")
    err = _code(lambda: raw(b"\xff\xff\xff", metadata=md))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "rlserve.v1.GetRunRequest" in err.details()
    err = _code(lambda: ch.unary_unary("/rlserve.v1.Coordinator/Explode")(b"", metadata=md))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    err = _code(lambda: stub.GetRun(pb.GetRunRequest(run_id="missing"), metadata=md))
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == "run 'missing'"
    err = _code(lambda: stub.GetRun(pb.GetRunRequest(run_id="boom"), metadata=md))
    assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "RuntimeError: boom"
    events = list(stub.WatchRun(pb.WatchRunRequest(run_id="w"), metadata=md))
    assert [e.event.sequence for e in events] == [0, 1, 2]
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    assert health.status == health_pb2.HealthCheckResponse.SERVING, "health checks need no token"


def test_tokens_rotate_without_a_restart(gateway):
    g = gateway()
    ch, old = g.channel(g.user)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    fresh = new_token()
    _write(g.user_file, fresh)
    time.sleep(1.2)
    assert _code(lambda: stub.ListRuns(pb.ListRunsRequest(), metadata=old)).code() == grpc.StatusCode.UNAUTHENTICATED
    stub.ListRuns(pb.ListRunsRequest(), metadata=(("authorization", f"Bearer {fresh}"),))
    os.chmod(g.user_file, 0o644)  # a file others may read holds no valid tokens (fail closed)
    time.sleep(1.2)
    err = _code(lambda: stub.ListRuns(pb.ListRunsRequest(), metadata=(("authorization", f"Bearer {fresh}"),)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_round_trip_with_a_self_signed_certificate(gateway):
    g = gateway(tls=True)
    ch, md = g.channel(g.user, secure=True)
    assert coordinator_pb2_grpc.CoordinatorStub(ch).GetRun(pb.GetRunRequest(run_id="t"), metadata=md).run.run_id == "t"
    plain, md = g.channel(g.user)
    err = _code(lambda: coordinator_pb2_grpc.CoordinatorStub(plain).GetRun(pb.GetRunRequest(run_id="t"), metadata=md,
                                                                           timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert g.calls == ["GetRun"]


def test_auth_none_lets_every_call_through(gateway):
    g = gateway(auth=False)
    ch, _ = g.channel()
    assert coordinator_pb2_grpc.CoordinatorStub(ch).GetRun(pb.GetRunRequest(run_id="o")).run.run_id == "o"


def test_one_caller_cannot_hold_every_stream_or_call(gateway):
    """Idle WatchRun streams once held every slot of the coordinator (80 of them made everyone's GetRun
    time out): a caller's streams beyond its limit are refused at once, and another caller, and the
    same caller's unary calls, go through."""
    g = gateway(limits=CallerLimits(max_streams=3))
    ch, md = g.channel(g.user)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    idle = [stub.WatchRun(pb.WatchRunRequest(run_id="r", from_sequence=10**12), metadata=md) for _ in range(3)]
    deadline = time.time() + 10
    while g.calls.count("WatchRun") < 3 and time.time() < deadline:
        time.sleep(0.01)
    err = _code(lambda: list(stub.WatchRun(pb.WatchRunRequest(run_id="r", from_sequence=10**12), metadata=md,
                                            timeout=5)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenancy.callers.max_streams" in err.details()
    assert stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=md, timeout=5).run.run_id == "r"
    other = coordinator_pb2_grpc.CoordinatorStub(g.channel(g.admin)[0])
    events = list(other.WatchRun(pb.WatchRunRequest(run_id="r"), metadata=g.channel(g.admin)[1], timeout=5))
    assert len(events) == 3
    for call in idle:
        call.cancel()


def test_oversized_requests_and_floods_get_resource_exhausted_before_forwarding(gateway):
    g = gateway(limits=CallerLimits(max_request_kb=256, calls_per_s=5, call_burst=5))
    ch, md = g.channel(g.user)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    # No internal RPCs on the endpoint: gRPC's transport refuses it from its length prefix, unread.
    err = _code(lambda: stub.SubmitRun(pb.SubmitRunRequest(spec_yaml="a" * (300 * 1024)), metadata=md))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.details()
    assert "SubmitRun" not in g.calls
    # With them, training batches come in and the limiter refuses an oversized run-facing call, naming the key.
    exposed = gateway(expose_internal=True, limits=CallerLimits(max_request_kb=256))
    err = _code(lambda: coordinator_pb2_grpc.CoordinatorStub(exposed.channel(exposed.user)[0]).SubmitRun(
        pb.SubmitRunRequest(spec_yaml="a" * (300 * 1024)), metadata=exposed.channel(exposed.user)[1]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenancy.callers.max_request_kb" in err.details()
    assert "SubmitRun" not in exposed.calls
    codes = []
    for _ in range(10):
        try:
            stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=md)
            codes.append("ok")
        except grpc.RpcError as e:
            codes.append(e.code())
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 4 and codes[:4] == ["ok"] * 4
    other = coordinator_pb2_grpc.CoordinatorStub(g.channel(g.admin)[0])
    assert other.GetRun(pb.GetRunRequest(run_id="r"), metadata=g.channel(g.admin)[1]).run.run_id == "r"


def _md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def test_every_forwarded_call_carries_its_callers_principal(gateway):
    """The principal, never the token, travels with the call: the legacy files are `user` and `admin`, a
    users-file token is its user, and without authentication there is none (the coordinator then acts as
    the cluster itself)."""
    g = gateway()
    alice = add_user(g.users_file, "alice", admin=False)
    root = add_user(g.users_file, "root", admin=True)
    time.sleep(1.2)  # the store re-reads changed files at most once a second
    ch, _ = g.channel()
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    for token in (g.user, g.admin, alice, root):
        stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=_md(token))
    list(stub.WatchRun(pb.WatchRunRequest(run_id="r"), metadata=_md(alice)))
    assert g.callers == [Principal("user", Role.USER), Principal("admin", Role.ADMIN),
                         Principal("alice", Role.USER), Principal("root", Role.ADMIN), Principal("alice", Role.USER)]
    open_gateway = gateway(auth=False)
    coordinator_pb2_grpc.CoordinatorStub(open_gateway.channel()[0]).ListRuns(pb.ListRunsRequest())
    assert open_gateway.callers == [None]


def test_users_file_admins_reach_internal_rpcs_and_users_do_not(gateway):
    g = gateway(expose_internal=True)
    alice, root = add_user(g.users_file, "alice", admin=False), add_user(g.users_file, "root", admin=True)
    time.sleep(1.2)
    stub = rollout_pb2_grpc.RolloutStub(g.channel()[0])
    err = _code(lambda: stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=_md(alice)))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stub.GetInfo(rollout_pb2.GetInfoRequest(), metadata=_md(root)).engine == "in-process"
    assert g.calls == ["GetInfo"]


def test_a_revoked_user_is_refused_within_two_seconds_and_others_are_not(gateway):
    g = gateway()
    alice, bob = add_user(g.users_file, "alice", admin=False), add_user(g.users_file, "bob", admin=False)
    time.sleep(1.2)
    stub = coordinator_pb2_grpc.CoordinatorStub(g.channel()[0])
    stub.ListRuns(pb.ListRunsRequest(), metadata=_md(alice))
    revoke_user(g.users_file, "alice")
    revoked = time.monotonic()
    while True:
        try:
            stub.ListRuns(pb.ListRunsRequest(), metadata=_md(alice))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            break
        assert time.monotonic() - revoked < 2.0, "a revoked user must be refused within 2 s"
        time.sleep(0.05)
    for token in (bob, g.user, g.admin):
        stub.ListRuns(pb.ListRunsRequest(), metadata=_md(token))
    (g.users_file).write_text("this is not a users file\n")  # a broken users file holds no one (fail closed)
    time.sleep(1.2)
    err = _code(lambda: stub.ListRuns(pb.ListRunsRequest(), metadata=_md(bob)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    stub.ListRuns(pb.ListRunsRequest(), metadata=_md(g.user))  # the token files are not affected


def test_limits_are_per_user_whatever_token_they_use(gateway):
    """All of a user's tokens share one set of limits (keyed on the principal's name, not the token), and
    another user has their own."""
    g = gateway(limits=CallerLimits(max_streams=1))
    second = new_token()
    _write(g.user_file, g.user, second)  # two tokens of the principal `user`
    alice = add_user(g.users_file, "alice", admin=False)
    time.sleep(1.2)
    stub = coordinator_pb2_grpc.CoordinatorStub(g.channel()[0])
    idle = stub.WatchRun(pb.WatchRunRequest(run_id="r", from_sequence=10**12), metadata=_md(g.user))
    deadline = time.time() + 10
    while g.calls.count("WatchRun") < 1 and time.time() < deadline:
        time.sleep(0.01)
    err = _code(lambda: list(stub.WatchRun(pb.WatchRunRequest(run_id="r", from_sequence=10**12),
                                            metadata=_md(second), timeout=5)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenancy.callers.max_streams" in err.details()
    assert len(list(stub.WatchRun(pb.WatchRunRequest(run_id="r"), metadata=_md(alice), timeout=5))) == 3
    idle.cancel()


def test_a_callers_identical_reads_share_one_forwarded_call_and_writes_are_read_at_once(gateway):
    """GetRun and ListRuns within `read_cache_ms` of an identical call by the same caller are answered
    without forwarding; another caller's are forwarded (answers never cross callers); a CancelRun (by
    anyone) makes the next reads forwarded again."""
    g = gateway(read_cache_ms=10_000)  # long enough for a loaded machine; expiry: test_read_cache.py
    ch, _ = g.channel()
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    for _ in range(5):
        assert stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=_md(g.user)).run.run_id == "r"
        stub.ListRuns(pb.ListRunsRequest(), metadata=_md(g.user))
    stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=_md(g.admin))
    assert g.calls == ["GetRun", "ListRuns", "GetRun"]
    assert g.callers[-1] == Principal("admin", Role.ADMIN)
    stub.CancelRun(pb.CancelRunRequest(run_id="r"), metadata=_md(g.user))
    stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=_md(g.user))
    stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=_md(g.admin))
    assert g.calls[3:] == ["CancelRun", "GetRun", "GetRun"]
    # A stream the service ended (a run's events up to its end) is a change too: the next read is forwarded.
    list(stub.WatchRun(pb.WatchRunRequest(run_id="r"), metadata=_md(g.user)))
    stub.GetRun(pb.GetRunRequest(run_id="r"), metadata=_md(g.user))
    assert g.calls[6:] == ["WatchRun", "GetRun"]


def test_reads_the_run_table_can_answer_reach_nothing_behind_the_gateway(gateway):
    """GetRun and ListRuns of runs the fed table holds are answered by the gateway alone; another user's
    run, a run a stream has shown newer than the table, and every read while the feed is down, are
    forwarded."""
    g = gateway()
    ch, md = g.channel(g.user)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    stub.GetRun(pb.GetRunRequest(run_id="mine"), metadata=md)  # no feed yet: forwarded
    me = g.callers[-1].name
    records = FeedBatch([pb.Run(run_id="mine", owner=me, step=3, updated_unix=10.0).SerializeToString(),
                         pb.Run(run_id="theirs", owner="someone-else", updated_unix=10.0).SerializeToString()])

    async def feed(change):
        change()
    g._run(feed(lambda: g.table.replace(records)))
    before = len(g.calls)
    for _ in range(20):
        assert stub.GetRun(pb.GetRunRequest(run_id="mine"), metadata=md).run.step == 3
        assert [r.run_id for r in stub.ListRuns(pb.ListRunsRequest(), metadata=md).runs] == ["mine"]
    assert len(g.calls) == before
    stub.GetRun(pb.GetRunRequest(run_id="theirs"), metadata=md)
    assert g.calls[before:] == ["GetRun"]
    list(stub.WatchRun(pb.WatchRunRequest(run_id="mine"), metadata=md))  # events newer than the table's record
    stub.GetRun(pb.GetRunRequest(run_id="mine"), metadata=md)
    assert g.calls[before + 1:] == ["WatchRun", "GetRun"]
    newer = pb.Run(run_id="mine", owner=me, step=4, updated_unix=time.time() + 1).SerializeToString()
    g._run(feed(lambda: g.table.update(FeedBatch([newer]))))
    assert stub.GetRun(pb.GetRunRequest(run_id="mine"), metadata=md).run.step == 4
    assert len(g.calls) == before + 3
    g._run(feed(g.table.down))
    stub.ListRuns(pb.ListRunsRequest(), metadata=md)
    assert g.calls[-1] == "ListRuns"


def test_watch_streams_are_served_from_the_fed_events_and_forwarded_from_where_the_copy_ends(gateway):
    """Idle watchers held a request each at the coordinator: a run whose events the table holds is watched
    at the gateway alone, any number of streams (within the caller's limit) holding nothing behind it; when
    the copy cannot go on (here: the feed goes down), the stream continues forwarded from its next event."""
    g = gateway()
    ch, md = g.channel(g.user)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    stub.GetRun(pb.GetRunRequest(run_id="mine"), metadata=md)
    me = g.callers[-1].name

    def ev(seq: int, state: int = pb.RUN_STATE_RUNNING) -> bytes:
        return pb.RunEvent(run_id="mine", sequence=seq, state=state, time_unix=time.time()).SerializeToString()

    async def feed(change):
        change()
    g._run(feed(lambda: g.table.replace(FeedBatch(
        [pb.Run(run_id="mine", owner=me, updated_unix=time.time()).SerializeToString()], [ev(0), ev(1)]))))
    before = len(g.calls)
    idle = [stub.WatchRun(pb.WatchRunRequest(run_id="mine", from_sequence=10**12), metadata=md) for _ in range(10)]
    watch = stub.WatchRun(pb.WatchRunRequest(run_id="mine"), metadata=md, timeout=30)
    assert [next(watch).event.sequence for _ in range(2)] == [0, 1]
    g._run(feed(lambda: g.table.update(FeedBatch([], [ev(2)]))))
    assert next(watch).event.sequence == 2
    assert len(g.calls) == before  # nothing forwarded, the idle streams included
    g._run(feed(g.table.down))
    assert [r.event.sequence for r in watch] == [3, 4, 5]  # the forwarder's events from 3 on
    deadline = time.time() + 10
    while len(g.watched_from) < 11 and time.time() < deadline:
        time.sleep(0.01)
    assert sorted(g.watched_from) == [3] + [10**12] * 10  # each stream went on from where it was
    for call in idle:
        call.cancel()
    before = len(g.calls)
    g._run(feed(lambda: g.table.replace(FeedBatch(
        [pb.Run(run_id="mine", owner=me, updated_unix=time.time()).SerializeToString()],
        [ev(0), ev(1, pb.RUN_STATE_CANCELLED)]))))
    assert [r.event.sequence for r in stub.WatchRun(pb.WatchRunRequest(run_id="mine"), metadata=md, timeout=30)
            ] == [0, 1]  # served here, ending with the run
    past_the_end = stub.WatchRun(pb.WatchRunRequest(run_id="mine", from_sequence=10**12), metadata=md, timeout=30)
    assert list(past_the_end) == [] and past_the_end.code() == grpc.StatusCode.OK
    assert len(g.calls) == before
