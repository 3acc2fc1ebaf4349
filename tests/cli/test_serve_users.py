"""Smoke tests of `deploy/serve users` and `deploy/serve quotas` (the same entry point, `rlserve.cluster.cli`,
without the setup step): no cluster needed."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import yaml


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlserve.cluster.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_users_add_list_revoke_and_quotas(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), "quotas": {
        "default": {"max_queued_runs": 2}, "users": {"alice": {"max_concurrent_runs": 1}}}}))
    added = serve("users", "add", "alice", "-c", str(cluster))
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert len(token) >= 32 and "only time the token is shown" in added.stderr
    users = tmp_path / "runs" / ".cluster" / "users"
    assert token not in users.read_text() and hashlib.sha256(token.encode()).hexdigest() in users.read_text()
    assert serve("users", "add", "root", "--admin", "-c", str(cluster)).returncode == 0
    again = serve("users", "add", "alice", "-c", str(cluster))
    assert again.returncode != 0 and "exists already" in again.stderr
    listed = serve("users", "list", "-c", str(cluster)).stdout.splitlines()
    assert [line.split()[:2] for line in listed[1:]] == [["user", "user"], ["admin", "admin"], ["alice", "user"],
                                                          ["root", "admin"]]
    assert token not in "".join(listed)
    quotas = serve("quotas", "-c", str(cluster)).stdout.splitlines()
    assert quotas[0].split() == ["name", "concurrent", "queued", "samples/run", "priority"]
    assert quotas[1].split() == ["user", "8", "2", "100000000", "1"]
    assert quotas[3].split() == ["alice", "1", "2", "100000000", "1"]
    assert "not limited (admin)" in quotas[2] and "not limited (admin)" in quotas[4]
    revoked = serve("users", "revoke", "alice", "-c", str(cluster))
    assert revoked.returncode == 0 and "their runs go on" in revoked.stderr
    assert "alice" not in users.read_text()
    missing = serve("users", "revoke", "alice", "-c", str(cluster))
    assert missing.returncode != 0 and "no user 'alice'" in missing.stderr
    bad = serve("users", "add", "Not-A-Name", "-c", str(cluster))
    assert bad.returncode != 0 and "a user name is" in bad.stderr
    assert serve("users", "add", "-c", str(cluster)).returncode == 2  # a NAME is needed


def test_users_with_auth_none_say_there_are_none(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), "auth": "none"}))
    out = serve("users", "list", "-c", str(cluster))
    assert out.returncode != 0 and "auth: none" in out.stderr
