"""One real local Ray cluster with every Serve app, shared by all integration tests.

It is brought up once per session with the same code as `deploy/serve up`
(a Ray head bound to loopback, Serve's gRPC proxy, the five applications
from a cluster file) and torn down at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
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


@pytest.fixture(scope="session")
def test_cluster(tmp_path_factory) -> TestCluster:
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    root = tmp_path_factory.mktemp("cluster")
    data = yaml.safe_load((HERE / "cluster.yaml").read_text())
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
def channel(test_cluster) -> grpc.Channel:
    ch = test_cluster.channel()
    yield ch
    ch.close()
