"""The cluster file and the Serve config derived from it."""

from __future__ import annotations

import pytest
import yaml

from rlserve.cluster.config import load_cluster_file
from rlserve.cluster.loopback import rewrite
from rlserve.cluster.serve_config import APPS, SERVICERS, serve_config
from rlserve.config.errors import SpecError

DEFAULT = "deploy/cluster.yaml"


def test_default_cluster_is_loopback_and_complete():
    from pathlib import Path

    cfg, runs = load_cluster_file(Path(DEFAULT))
    assert cfg.loopback and cfg.address is None
    config = serve_config(cfg, runs)
    assert config["http_options"]["host"] == "127.0.0.1"
    assert [a["name"] for a in config["applications"]] == list(APPS)
    assert all(a["route_prefix"] == f"/{a['name']}" for a in config["applications"])
    assert len(config["grpc_options"]["grpc_servicer_functions"]) == len(SERVICERS) == 5
    coord = next(a for a in config["applications"] if a["name"] == "coordinator")
    assert coord["args"]["runs_dir"] == str(runs)


def test_cluster_file_errors_name_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"services": {"rollout": {"replica": 2}}}))
    with pytest.raises(SpecError) as err:
        load_cluster_file(path)
    assert err.value.problems[0].startswith("services.rollout.replica: unknown key")


@pytest.mark.parametrize("address, host, want", [
    ("[::]:9000", "127.0.0.1", "127.0.0.1:9000"), ("0.0.0.0:0", "127.0.0.1", "127.0.0.1:0"),
    ("10.0.0.1:9000", "127.0.0.1", "10.0.0.1:9000")])
def test_wildcard_rewrite(address, host, want):
    assert rewrite(address, host) == want


def test_kuberay_manifest_deploys_the_same_apps():
    from pathlib import Path

    manifest = yaml.safe_load(Path("deploy/kuberay/rayservice.yaml").read_text())
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert {a["name"]: a["import_path"] for a in config["applications"]} == APPS
    assert config["grpc_options"]["grpc_servicer_functions"] == SERVICERS
