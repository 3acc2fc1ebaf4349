"""One real local Ray cluster with every Serve app, shared by all integration tests.

It is brought up once per session with the same code as `deploy/serve up`
(a Ray head bound to loopback, the authenticating gateway, the services from
a cluster file) and torn down at the end. Authentication is on, with the
token files `up` creates; the cluster exposes the internal services to the
admin token, which the `channel` fixture carries (tests of the services call
them directly). `CoordinatorClient` finds the user token the way `rlserve`
does, from the record `up` wrote.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

HERE = Path(__file__).parent


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
    # An allow-listed reward plug-in file: it raises for the completion '9' and scores 0.5 otherwise.
    plugin: str

    def token(self, admin: bool = False) -> str:
        from rlserve.security.tokens import read_tokens

        return read_tokens(self.cluster.token_files[1 if admin else 0])[0]

    def channel(self, token: str | None = None) -> grpc.Channel:
        """A channel to the endpoint that sends `token` with every call (none: no token)."""
        channel = grpc.insecure_channel(self.endpoint)
        return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


@pytest.fixture(scope="session")
def test_cluster(tmp_path_factory) -> TestCluster:
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up

    root = tmp_path_factory.mktemp("cluster")
    data = yaml.safe_load((HERE / "cluster.yaml").read_text())
    data.update({"runs_dir": str(root / "runs"), "model_dirs": [str(root / "models")],
                 "data_dirs": [str(root / "data")]})
    (root / "models").mkdir()
    (root / "data").mkdir()
    plugin = root / "plugins" / "flaky.py"
    plugin.parent.mkdir()
    plugin.write_text("def reward(item):\n    if item.completion == '9':\n        raise KeyError('oops')\n"
                      "    return 0.5\n")
    data["reward"]["allowed_plugins"].append(f"{plugin}:reward")
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(data))
    cfg, runs_dir = load_cluster_file(cluster_file)
    cluster = Cluster(cfg, runs_dir)
    down(cluster)  # a leftover from an interrupted session
    up(cluster)
    try:
        yield TestCluster(cluster, cluster.grpc_endpoint, runs_dir, cluster_file, root / "models", root / "data",
                          f"{plugin}:reward")
    finally:
        down(cluster)


@pytest.fixture(scope="session")
def channel(test_cluster) -> grpc.Channel:
    """A channel with the admin token: it reaches the internal services (the test cluster exposes them)."""
    ch = test_cluster.channel(test_cluster.token(admin=True))
    yield ch
    ch.close()
