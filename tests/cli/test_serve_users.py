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
    cluster.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), "tenancy": {
        "default_user": {"max_waiting_runs": 2}, "users": {"alice": {"max_unfinished_runs": 1}}}}))
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
    shown = serve("quotas", "-c", str(cluster))
    assert "deprecated" not in shown.stderr
    assert "every user's runs together: at most 4 train at once (tenancy.cluster.max_training_runs)" in shown.stderr
    quotas = shown.stdout.splitlines()
    assert quotas[0].split() == ["name", "unfinished", "waiting", "samples/run", "priority"]
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


def test_a_cluster_file_with_old_keys_still_works_and_each_old_key_is_warned_of(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), "max_concurrent_runs": 2, "quotas": {
        "default": {"max_queued_runs": 2}, "users": {"alice": {"max_concurrent_runs": 1}}}}))
    shown = serve("quotas", "-c", str(cluster))
    assert shown.returncode == 0, shown.stderr
    warnings = [line for line in shown.stderr.splitlines() if "deprecated" in line]
    assert warnings == [f"serve: WARNING: {cluster}: `{old}` is deprecated; use `{new}` (the value is read as that)"
                        for old, new in (("quotas.default.max_queued_runs", "tenancy.default_user.max_waiting_runs"),
                                         ("quotas.users.alice.max_concurrent_runs",
                                          "tenancy.users.alice.max_unfinished_runs"),
                                         ("max_concurrent_runs", "tenancy.cluster.max_training_runs"))]
    assert "at most 2 train at once" in shown.stderr
    assert shown.stdout.splitlines()[3].split() == ["alice", "1", "2", "100000000", "1"]
    cluster.write_text(yaml.safe_dump({"quotas": {"default": {"max_queued_runs": 2}},
                                       "tenancy": {"default_user": {"max_waiting_runs": 3}}}))
    both = serve("quotas", "-c", str(cluster))
    assert both.returncode == 1 and ("quotas.default.max_queued_runs: deprecated, and "
                                     "tenancy.default_user.max_waiting_runs sets the same limit") in both.stderr
