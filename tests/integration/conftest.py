"""Real local Ray clusters with every Serve app for the integration tests.

`test_cluster` is ONE cluster shared by the session (`cluster.yaml`); tests that stop a cluster or lose a
node bring up one of their own with `running_cluster` (other ports, its own runs directory), so they
neither disturb the shared one nor depend on test order. Each is brought up with the same code as
`deploy/serve up` (a Ray head bound to loopback, extra nodes if the file has any, the authenticating
gateway, the services) and torn down when done: the shared one after the last test that uses it, and the
modules with clusters of their own run after the shared cluster's (an idle cluster takes a tenth of a
2-core machine from every test beside it). Authentication is on, with the token files `up`
creates; the clusters expose the internal services to the admin token, which the `channel` fixture
carries (tests of the services call them directly). `CoordinatorClient` finds the user token the way
`rlserve` does, from the record `up` wrote.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

HERE = Path(__file__).parent
# Where the example plug-in package lies (tests/plugins, a distribution by its dist-info): every process
# of a test cluster imports from there, as if it were installed on every node.
PLUGINS_PATH = HERE.parent / "plugins"
# Reward plug-ins the test clusters allow-list, by name: (file in reward_plugins/, attribute).
PLUGINS = {"flaky": ("flaky.py", "reward"), "outage": ("outage.py", "Outage"), "broken": ("broken.py", "reward")}


def plugin(name: str) -> str:
    """The import path of an allow-listed test plug-in."""
    file, attr = PLUGINS[name]
    return f"{HERE / 'reward_plugins' / file}:{attr}"


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call of a channel."""

    class _Details(collections.namedtuple("_Details", ["method", "timeout", "metadata", "credentials",
                                                       "wait_for_ready", "compression"]),
                   grpc.ClientCallDetails):
        pass

    def __init__(self, token: str):
        self.token = token

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.token}")]
        return self._Details(details.method, details.timeout, metadata, details.credentials,
                             details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


@dataclass
class TestCluster:
    cluster: object
    endpoint: str
    runs_dir: Path
    cluster_file: Path
    # Inside the cluster file's model_dirs and data_dirs: where tests put models and data they name.
    models_dir: Path
    data_dir: Path
    # The allow-listed plug-in reward_plugins/flaky.py: it raises for the completion '9', else scores 0.5.
    plugin: str

    def token(self, admin: bool = False) -> str:
        from rlserve.security.tokens import read_tokens

        return read_tokens(self.cluster.token_files[1 if admin else 0])[0]

    def channel(self, token: str | None = None) -> grpc.Channel:
        """A channel to the endpoint that sends `token` with every call (none: no token)."""
        channel = grpc.insecure_channel(self.endpoint)
        return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


def listeners_of(pid_file: Path, include_this_process: bool = False) -> list:
    """Listening sockets of the process group a node's pid file names (ray start and all it spawned)."""
    pgid = os.getpgid(int(pid_file.read_text()))
    ours = {p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid}
    if include_this_process:
        ours.add(os.getpid())
    return [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]


def is_loopback(ip: str) -> bool:
    return ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def install_plugins() -> None:
    """The example plug-in package on the import path of the Ray processes started from here (they inherit
    this environment)."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(PLUGINS_PATH) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PLUGINS_PATH), *filter(None, paths)])


@contextmanager
def running_cluster(cluster_yaml: Path, root: Path) -> Iterator[TestCluster]:
    """Bring up the cluster of `cluster_yaml` with its runs under `root`; tear it down afterwards."""
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    data = yaml.safe_load(cluster_yaml.read_text())
    # Several checkouts on one machine: RLSERVE_TEST_PORT_OFFSET moves this session's clusters to other ports.
    offset = int(os.environ.get("RLSERVE_TEST_PORT_OFFSET", "0"))
    for key in ("ray_port", "grpc_port", "http_port"):
        if key in data:
            data[key] += offset
    data.update({"runs_dir": str(root / "runs"), "model_dirs": [str(root / "models")],
                 "data_dirs": [str(root / "data")]})
    (root / "models").mkdir()
    (root / "data").mkdir()
    data.setdefault("reward", {}).setdefault("allowed_plugins", []).extend(plugin(n) for n in PLUGINS)
    # Reward models (reward_model, llm_judge) tests generate: in models/reward.
    data["reward"].setdefault("allowed_models", []).append(str(root / "models" / "reward"))
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(data))
    cfg, runs_dir = load_cluster_file(cluster_file)
    cluster = Cluster(cfg, runs_dir)
    down(cluster)  # a leftover from an interrupted session
    install_plugins()
    up(cluster)
    try:
        yield TestCluster(cluster, cluster.grpc_endpoint, runs_dir, cluster_file, root / "models", root / "data",
                          plugin("flaky"))
    finally:
        down(cluster)


# The shared cluster's teardown: run by `pytest_runtest_teardown` after the last test that uses it, or at the
# session's end (closing it twice does nothing).
_SHARED = ExitStack()
_SHARED_LAST: list[str] = []  # the node id of the last test that uses the shared cluster


@pytest.fixture(scope="session")
def test_cluster(tmp_path_factory) -> TestCluster:
    with _SHARED:
        yield _SHARED.enter_context(running_cluster(HERE / "cluster.yaml", tmp_path_factory.mktemp("cluster")))


def _uses_shared(item: pytest.Item) -> bool:
    return "test_cluster" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """Integration modules none of whose tests use the shared cluster (those that bring up their own) run after
    the last module that does, so that the shared cluster is down by then."""
    here = [i for i in items if HERE in i.path.parents]
    if not here:
        return
    shared_modules = {i.path for i in here if _uses_shared(i)}
    later = [i for i in here if i.path not in shared_modules]
    if not later or not shared_modules:
        return
    last = max(k for k, i in enumerate(items) if i.path in shared_modules)
    moved = set(map(id, later))
    items[:] = ([i for i in items[:last + 1] if id(i) not in moved] + later
                + [i for i in items[last + 1:] if id(i) not in moved])


def pytest_collection_finish(session):
    users = [i.nodeid for i in session.items if _uses_shared(i)]
    _SHARED_LAST[:] = users[-1:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared cluster goes down after the last test that uses it (its module's fixtures are gone by then)."""
    result = yield
    if _SHARED_LAST and item.nodeid == _SHARED_LAST[0]:
        _SHARED.close()
    return result


@pytest.fixture
def ray_driver(test_cluster) -> TestCluster:
    """This process attached to the shared cluster as a Ray driver (a test with a cluster of its own may
    have attached it elsewhere)."""
    from rlserve.cluster.lifecycle import connect

    connect(test_cluster.cluster)
    return test_cluster


@pytest.fixture(scope="session")
def channel(test_cluster) -> grpc.Channel:
    """A channel with the admin token: it reaches the internal services (the test cluster exposes them)."""
    ch = test_cluster.channel(test_cluster.token(admin=True))
    yield ch
    ch.close()
