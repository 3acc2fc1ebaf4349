"""Per-user quotas: how entries combine, and the cluster file re-read when it changes (no restart), a
broken edit leaving the last good quotas in force."""

from __future__ import annotations

import time

import grpc
import pytest
import yaml

from rlserve.config import load_spec
from rlserve.rpc import RpcError
from rlserve.runs.quotas import Quotas, QuotasCfg
from rlserve.security.principal import SYSTEM, Principal, Role

ALICE, BOB, ROOT = Principal("alice", Role.USER), Principal("bob", Role.USER), Principal("root", Role.ADMIN)
SPEC = load_spec(yaml.safe_dump({"grpo": {"max_num_steps": 2, "num_prompts_per_step": 4,
                                          "num_generations_per_prompt": 2}}))


def test_user_entries_override_the_default_key_by_key_and_admins_are_not_limited():
    cfg = QuotasCfg.model_validate({"default": {"max_queued_runs": 3},
                                    "users": {"alice": {"max_concurrent_runs": 1}, "root": {"max_queued_runs": 2}}})
    alice = cfg.limits(ALICE)
    assert (alice.values.max_concurrent_runs, alice.values.max_queued_runs) == (1, 3)
    assert alice.key("max_concurrent_runs") == "quotas.users.alice.max_concurrent_runs"
    assert alice.key("max_queued_runs") == "quotas.default.max_queued_runs"
    assert cfg.limits(BOB).values.max_queued_runs == 3 and cfg.limits(BOB).values.max_concurrent_runs == 8
    assert cfg.limits(SYSTEM) is None and cfg.limits(Principal("admin", Role.ADMIN)) is None
    assert cfg.limits(ROOT).values.max_queued_runs == 2
    with pytest.raises(ValueError, match="not user names"):
        QuotasCfg.model_validate({"users": {"Alice!": {}}})
    with pytest.raises(ValueError):
        QuotasCfg.model_validate({"default": {"max_queued_runs": 0}})


def _write(path, quotas) -> None:
    path.write_text(yaml.safe_dump({"name": "c", "grpc_port": 9000, "quotas": quotas}))


def _code(fn) -> str:
    try:
        fn()
    except RpcError as err:
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        return err.message
    return "ok"


def test_the_cluster_file_is_re_read_when_it_changes(tmp_path):
    path = tmp_path / "cluster.yaml"
    _write(path, {"default": {"max_queued_runs": 2}})
    quotas = Quotas(QuotasCfg(), path)  # what the coordinator was deployed with is replaced by the file's
    assert _code(lambda: quotas.check_submit(ALICE, SPEC, unfinished=1, queued=1)) == "ok"
    assert "max_queued_runs" in _code(lambda: quotas.check_submit(ALICE, SPEC, unfinished=2, queued=2))
    _write(path, {"default": {"max_queued_runs": 5}, "users": {"alice": {"max_samples_per_run": 15}}})
    changed = time.monotonic()
    while _code(lambda: quotas.check_submit(ALICE, SPEC, unfinished=2, queued=2)) == (
            "quota max_queued_runs (quotas.default.max_queued_runs) is 2: 2 of your runs are waiting to start; "
            "submit when one has started"):
        assert time.monotonic() - changed < 2.0, "an edited quota applies within about a second"
        time.sleep(0.05)
    assert "quotas.users.alice.max_samples_per_run) is 15" in _code(
        lambda: quotas.check_submit(ALICE, SPEC, unfinished=0, queued=0))
    assert _code(lambda: quotas.check_submit(BOB, SPEC, unfinished=4, queued=4)) == "ok"

    path.write_text("quotas: {default: {max_queued_runs: [")  # a broken edit: the last good quotas stay
    time.sleep(1.1)
    assert "max_samples_per_run" in _code(lambda: quotas.check_submit(ALICE, SPEC, unfinished=0, queued=0))
    _write(path, {"default": {"max_queued_runs": "many"}})
    time.sleep(1.1)
    assert quotas.current().limits(BOB).values.max_queued_runs == 5
    path.unlink()
    time.sleep(1.1)
    assert quotas.current().limits(BOB).values.max_queued_runs == 5


def test_without_a_cluster_file_the_deployed_quotas_hold(tmp_path):
    quotas = Quotas(QuotasCfg.model_validate({"default": {"max_concurrent_runs": 1}}), None)
    assert "max_concurrent_runs" in _code(lambda: quotas.check_submit(BOB, SPEC, unfinished=1, queued=0))
    assert _code(lambda: quotas.check_submit(ROOT, SPEC, unfinished=100, queued=100)) == "ok"


def test_priority_just_under_and_just_over_the_quota():
    quotas = Quotas(QuotasCfg.model_validate({"users": {"carol": {"max_priority": 2.5}}}), None)
    carol = Principal("carol", Role.USER)
    spec = SPEC.model_copy(update={"priority": 2.5})
    assert _code(lambda: quotas.check_submit(carol, spec, unfinished=0, queued=0)) == "ok"
    over = SPEC.model_copy(update={"priority": 2.6})
    assert _code(lambda: quotas.check_submit(carol, over, unfinished=0, queued=0)) == (
        "quota max_priority (quotas.users.carol.max_priority) is 2.5: spec_yaml: priority is 2.6")
    # By default every run takes one share: more needs the operator's say, less is anyone's choice.
    assert "quotas.default.max_priority) is 1:" in _code(lambda: quotas.check_submit(ALICE, spec, 0, 0))
    assert _code(lambda: quotas.check_submit(ALICE, SPEC.model_copy(update={"priority": 0.5}), 0, 0)) == "ok"
    assert _code(lambda: quotas.check_submit(ROOT, over, 0, 0)) == "ok"  # an admin without an entry
