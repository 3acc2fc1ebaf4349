"""The policy in force at the coordinator: the cluster file's `tenancy` section re-read when it changes (no
restart), old keys included and logged as deprecated, a broken edit leaving the last good policy in force."""

from __future__ import annotations

import logging
import time

import pytest
import yaml

from rlserve.config import load_spec
from rlserve.security.principal import Principal, Role
from rlserve.tenancy.live import LiveTenancy, read_policy
from rlserve.tenancy.policy import OverLimit, TenancyPolicy

ALICE, BOB, ROOT = Principal("alice", Role.USER), Principal("bob", Role.USER), Principal("root", Role.ADMIN)
SPEC = load_spec(yaml.safe_dump({"grpo": {"max_num_steps": 2, "num_prompts_per_step": 4,
                                          "num_generations_per_prompt": 2}}))


class Logged(logging.Handler):
    """What a logger logs, whether or not rlserve's own logging stops it propagating to pytest's."""

    def __init__(self, name: str):
        super().__init__()
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def coordinator_log():
    handler = Logged("rlserve.coordinator")
    handler.logger.addHandler(handler)
    yield handler.messages
    handler.logger.removeHandler(handler)


def _write(path, **sections) -> None:
    path.write_text(yaml.safe_dump({"name": "c", "grpc_port": 9000, **sections}))


def _answer(fn) -> str:
    try:
        fn()
    except OverLimit as err:
        return err.message
    return "ok"


def _until_changed(tenancy: LiveTenancy, before: TenancyPolicy) -> TenancyPolicy:
    changed = time.monotonic()
    while tenancy.current() == before:
        assert time.monotonic() - changed < 2.0, "an edit applies within about a second"
        time.sleep(0.05)
    return tenancy.current()


def test_the_cluster_file_is_re_read_when_it_changes(tmp_path):
    path = tmp_path / "cluster.yaml"
    _write(path, tenancy={"default_user": {"max_waiting_runs": 2}})
    tenancy = LiveTenancy(TenancyPolicy(), path)  # what the coordinator was deployed with is replaced by the file's
    assert _answer(lambda: tenancy.current().check_submit(ALICE, SPEC, unfinished=1, waiting=1)) == "ok"
    assert _answer(lambda: tenancy.current().check_submit(ALICE, SPEC, unfinished=2, waiting=2)) == (
        "quota max_waiting_runs (tenancy.default_user.max_waiting_runs) is 2: 2 of your runs are waiting to "
        "start; submit when one has started")
    _write(path, tenancy={"default_user": {"max_waiting_runs": 5}, "users": {"alice": {"max_samples_per_run": 15}},
                          "cluster": {"max_training_runs": 2, "queue_capacity": 3}})
    policy = _until_changed(tenancy, tenancy.current())
    assert "(tenancy.users.alice.max_samples_per_run) is 15" in _answer(
        lambda: policy.check_submit(ALICE, SPEC, unfinished=0, waiting=0))
    assert _answer(lambda: policy.check_submit(BOB, SPEC, unfinished=4, waiting=4)) == "ok"
    assert policy.may_train_beside(1) and not policy.may_train_beside(2)  # the cluster's limits are live too
    assert "tenancy.cluster.queue_capacity" in _answer(lambda: policy.check_queue(3))

    path.write_text("tenancy: {default_user: {max_waiting_runs: [")  # a broken edit: the last good policy stays
    time.sleep(1.1)
    assert tenancy.current() == policy
    _write(path, tenancy={"default_user": {"max_waiting_runs": "many"}})
    time.sleep(1.1)
    assert tenancy.current() == policy
    _write(path, quotas={"default": {"max_queued_runs": 1}}, tenancy={"default_user": {"max_waiting_runs": 2}})
    time.sleep(1.1)
    assert tenancy.current() == policy, "a limit given twice (old and new key) is no limit lifted"
    path.unlink()
    time.sleep(1.1)
    assert tenancy.current() == policy


def test_old_keys_in_the_file_are_read_live_and_logged_as_deprecated(tmp_path, coordinator_log):
    path = tmp_path / "cluster.yaml"
    _write(path, quotas={"default": {"max_queued_runs": 2}, "users": {"carol": {"max_concurrent_runs": 1}}},
           max_concurrent_runs=3)
    tenancy = LiveTenancy(TenancyPolicy(), path)
    policy = tenancy.current()
    assert (policy.default_user.max_waiting_runs, policy.users["carol"].max_unfinished_runs) == (2, 1)
    assert policy.cluster.max_training_runs == 3
    logged = [m for m in coordinator_log if "tenancy.deprecated_key" in m]
    assert logged == [f"event=tenancy.deprecated_key source={path} key={old} use={new}" for old, new in (
        ("quotas.default.max_queued_runs", "tenancy.default_user.max_waiting_runs"),
        ("quotas.users.carol.max_concurrent_runs", "tenancy.users.carol.max_unfinished_runs"),
        ("max_concurrent_runs", "tenancy.cluster.max_training_runs"))]
    # The message names the new key, whichever key the file used.
    assert _answer(lambda: policy.check_submit(Principal("carol", Role.USER), SPEC, 1, 0)).startswith(
        "quota max_unfinished_runs (tenancy.users.carol.max_unfinished_runs) is 1: ")
    _write(path, quotas={"default": {"max_queued_runs": 4}})
    assert _until_changed(tenancy, policy).default_user.max_waiting_runs == 4


def test_without_a_cluster_file_the_deployed_policy_holds():
    tenancy = LiveTenancy(TenancyPolicy.model_validate({"default_user": {"max_unfinished_runs": 1}}))
    assert "max_unfinished_runs" in _answer(lambda: tenancy.current().check_submit(BOB, SPEC, 1, 0))
    assert _answer(lambda: tenancy.current().check_submit(ROOT, SPEC, unfinished=100, waiting=100)) == "ok"


def test_read_policy_takes_only_the_tenancy_section(tmp_path):
    path = tmp_path / "cluster.yaml"
    _write(path, tenancy={"users": {"bob": {}}}, services={"rollout": {"args": {"anything": 1}}})
    policy, moved = read_policy(path)
    assert set(policy.users) == {"bob"} and moved == {}
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a mapping"):
        read_policy(path)
