"""The cluster file's `ray` section: Ray's and Serve's own intervals reach every process of the cluster, and the
log monitor starts only when asked for."""

from __future__ import annotations

import socket

import pytest
import yaml

from rlserve.cluster import lifecycle
from rlserve.cluster.config import ClusterFile, default_cluster_file, load_cluster_file
from rlserve.config.errors import SpecError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_command(cfg: ClusterFile, tmp_path, monkeypatch) -> tuple[list[str], dict[str, str]]:
    """What `start_head` would run, and with which environment (the process is not started)."""
    seen = {}

    class _Exited:
        returncode, pid = 1, 0

        def __init__(self, cmd, env, **_):
            seen.update(cmd=cmd, env=env)

        def poll(self) -> int:
            return 1

    monkeypatch.setattr(lifecycle.subprocess, "Popen", _Exited)
    with pytest.raises(RuntimeError, match="ray start failed"):
        lifecycle.start_head(lifecycle.Cluster(cfg, tmp_path / "runs"))
    return seen["cmd"], seen["env"]


def test_the_default_cluster_sets_rays_intervals_for_an_idle_small_cluster(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, runs = load_cluster_file(default_cluster_file())
    assert cfg.ray == ClusterFile().ray  # the embedded file spells out the model's defaults
    env = lifecycle.Cluster(cfg, runs).env()  # the head, the nodes, and every driver's workers get it
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "10000"
    assert env["RAY_metrics_report_interval_ms"] == "60000"
    assert env["REPORTER_UPDATE_INTERVAL_MS"] == "60000"
    assert env["RAY_num_workers_soft_limit"] == "0"
    cmd, head_env = _head_command(cfg.model_copy(update={"ray_port": _free_port()}), tmp_path, monkeypatch)
    assert "--include-log-monitor=false" in cmd and "--include-dashboard=false" in cmd
    assert head_env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"


def test_rays_own_defaults_come_back_key_by_key_and_env_adds_any_other_setting(tmp_path, monkeypatch):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"ray_port": _free_port(), "ray": {
        "log_monitor": True, "serve_control_loop_interval_s": 0.1, "serve_metrics_export_interval_ms": 100,
        "metrics_report_interval_ms": 10_000, "dashboard_agent_report_interval_ms": 5000,
        "num_workers_soft_limit": -1, "env": {"RAY_event_stats": "0"}}}))
    cfg, runs = load_cluster_file(path)
    env = lifecycle.Cluster(cfg, runs).env()
    assert (env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"], env["RAY_num_workers_soft_limit"], env["RAY_event_stats"]) \
        == ("0.1", "-1", "0")
    cmd, _ = _head_command(cfg, tmp_path, monkeypatch)
    assert "--include-log-monitor=true" in cmd


def test_an_unknown_ray_key_is_refused_naming_it(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"ray": {"control_loop_s": 1}}))
    with pytest.raises(SpecError, match="ray.control_loop_s"):
        load_cluster_file(path)
