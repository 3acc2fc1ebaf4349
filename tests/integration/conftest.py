"""Real local Ray clusters with every Serve app for the integration tests.

`test_cluster` is ONE cluster shared by the session (`cluster.yaml`); tests that stop a cluster or lose a
node bring up one of their own with `running_cluster` (other ports, its own runs directory), so they
neither disturb the shared one nor depend on test order. Each is brought up with the same code as
`deploy/serve up` (a Ray head bound to loopback, extra nodes if the file has any, Serve's gRPC proxy, the
five applications) and torn down at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

HERE = Path(__file__).parent


@dataclass
class TestCluster:
    cluster: object
    endpoint: str
    runs_dir: Path
    cluster_file: Path

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.endpoint)


def metadata(app: str) -> tuple[tuple[str, str], ...]:
    return (("application", app),)


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


@contextmanager
def running_cluster(cluster_yaml: Path, root: Path) -> Iterator[TestCluster]:
    """Bring up the cluster of `cluster_yaml` with its runs under `root`; tear it down afterwards."""
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    data = yaml.safe_load(cluster_yaml.read_text())
    data["runs_dir"] = str(root / "runs")
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(data))
    cfg, runs_dir = load_cluster_file(cluster_file)
    cluster = Cluster(cfg, runs_dir)
    down(cluster)  # a leftover from an interrupted session
    up(cluster)
    try:
        yield TestCluster(cluster, cluster.grpc_endpoint, runs_dir, cluster_file)
    finally:
        down(cluster)


@pytest.fixture(scope="session")
def test_cluster(tmp_path_factory) -> TestCluster:
    with running_cluster(HERE / "cluster.yaml", tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def ray_driver(test_cluster) -> TestCluster:
    """This process attached to the shared cluster as a Ray driver (a test with a cluster of its own may
    have attached it elsewhere)."""
    from rlserve.cluster.lifecycle import connect

    connect(test_cluster.cluster)
    return test_cluster


@pytest.fixture(scope="session")
def channel(test_cluster) -> grpc.Channel:
    ch = test_cluster.channel()
    yield ch
    ch.close()
