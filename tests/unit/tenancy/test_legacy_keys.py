"""The limits' old keys (`rlserve.tenancy.legacy`): each still sets its limit, read as its new key in the
`tenancy` section with a note naming both; an old key beside its new key is an error naming both."""

from __future__ import annotations

import pytest
import yaml

from rlserve.cluster.config import ClusterFile, load_cluster_file
from rlserve.config.errors import SpecError
from rlserve.tenancy.legacy import CLUSTER_FILE, COORDINATOR_ARGS, GATEWAY_ARGS, LegacyKeyError, migrate

# Every old key of the cluster file, a value for it, and the key of the `tenancy` section it now sets.
OLD_KEYS = [
    ("limits.max_streams", 3, "tenancy.callers.max_streams"),
    ("limits.max_in_flight", 4, "tenancy.callers.max_calls_in_flight"),
    ("limits.rate", 5.0, "tenancy.callers.calls_per_s"),
    ("limits.burst", 6, "tenancy.callers.call_burst"),
    ("limits.max_request_kb", 7, "tenancy.callers.max_request_kb"),
    ("services.coordinator.args.spec_reading_share", 0.5, "tenancy.callers.spec_reading_share"),
    ("quotas.default.max_concurrent_runs", 2, "tenancy.default_user.max_unfinished_runs"),
    ("quotas.default.max_queued_runs", 3, "tenancy.default_user.max_waiting_runs"),
    ("quotas.default.max_samples_per_run", 1000, "tenancy.default_user.max_samples_per_run"),
    ("quotas.default.max_priority", 2.0, "tenancy.default_user.max_priority"),
    ("quotas.users.bob.max_concurrent_runs", 1, "tenancy.users.bob.max_unfinished_runs"),
    ("quotas.users.bob.max_queued_runs", 1, "tenancy.users.bob.max_waiting_runs"),
    ("quotas.users.bob.max_samples_per_run", 10, "tenancy.users.bob.max_samples_per_run"),
    ("quotas.users.bob.max_priority", 3.0, "tenancy.users.bob.max_priority"),
    ("max_concurrent_runs", 2, "tenancy.cluster.max_training_runs"),
    ("services.coordinator.args.max_concurrent_runs", 3, "tenancy.cluster.max_training_runs"),
    ("services.coordinator.args.max_queued_runs", 9, "tenancy.cluster.queue_capacity"),
]
# The coordinator's own `quotas` arg, in the cluster file (it was overwritten by the top-level `quotas`).
OLD_KEYS += [(f"services.coordinator.args.{old}", value, new) for old, value, new in OLD_KEYS
             if old.startswith("quotas.")]


def nested(path: str, value) -> dict:
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def at(model, path: str):
    for part in path.split(".")[1:]:
        model = model[part] if isinstance(model, dict) else getattr(model, part)
    return model


def test_every_old_key_of_the_cluster_file_is_in_the_table():
    moved = {old.replace("*", "bob") for old, _ in CLUSTER_FILE.moves if not old.endswith("*")}
    assert moved == {old for old, _, _ in OLD_KEYS}


@pytest.mark.parametrize("old, value, new", OLD_KEYS, ids=[o for o, _, _ in OLD_KEYS])
def test_an_old_key_sets_its_limit_and_names_its_new_key(tmp_path, old, value, new):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(nested(old, value)))
    cfg, _ = load_cluster_file(path)
    assert at(cfg.tenancy, new) == value
    assert cfg.deprecated_keys == {old: new}
    assert not set(cfg.services.coordinator.args) & {"quotas", "max_queued_runs", "max_concurrent_runs",
                                                     "spec_reading_share"}


@pytest.mark.parametrize("old, value, new", OLD_KEYS, ids=[o for o, _, _ in OLD_KEYS])
def test_an_old_key_beside_its_new_key_is_an_error_naming_both(tmp_path, old, value, new):
    path = tmp_path / "cluster.yaml"
    data = nested(old, value)
    data["tenancy"] = nested(new, value)["tenancy"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_cluster_file(path)
    assert err.value.problems[0] == f"{old}: deprecated, and {new} sets the same limit; keep only {new}"


def test_two_old_keys_of_one_limit_are_an_error_naming_both():
    with pytest.raises(LegacyKeyError) as err:
        migrate({"max_concurrent_runs": 2, "services": {"coordinator": {"args": {"max_concurrent_runs": 3}}}},
                CLUSTER_FILE)
    assert str(err.value) == ("services.coordinator.args.max_concurrent_runs: deprecated, and max_concurrent_runs "
                              "(deprecated too) sets the same limit; keep only tenancy.cluster.max_training_runs")


def test_old_and_new_keys_of_different_limits_combine():
    cfg = ClusterFile.model_validate({"quotas": {"users": {"bob": {"max_queued_runs": 1}}},
                                      "tenancy": {"users": {"bob": {"max_priority": 2.0}}, "cluster": {
                                          "queue_capacity": 5}}, "max_concurrent_runs": 2})
    assert cfg.tenancy.users["bob"].model_dump(exclude_none=True) == {"max_waiting_runs": 1, "max_priority": 2.0}
    assert (cfg.tenancy.cluster.max_training_runs, cfg.tenancy.cluster.queue_capacity) == (2, 5)


def test_an_empty_users_entry_still_limits_an_admin():
    cfg = ClusterFile.model_validate({"quotas": {"users": {"root": {}}}})
    assert cfg.tenancy.users == {"root": cfg.tenancy.users["root"]} and cfg.deprecated_keys == {
        "quotas.users.root": "tenancy.users.root"}
    assert ClusterFile.model_validate({"quotas": {}}).deprecated_keys == {"quotas": "tenancy"}


@pytest.mark.parametrize("data, problem", [
    ({"quotas": {"users": {"bob": {"max_runs": 1}}}},
     "quotas.users.bob.max_runs: unknown key (allowed here: max_concurrent_runs, max_priority, max_queued_runs, "
     "max_samples_per_run)"),
    ({"quotas": {"defaults": {}, "default": {"max_queued_runs": 2}, "extra": 1}},
     "quotas.extra: unknown key (allowed here: default, users)"),
    ({"limits": {"rate": 1, "max_rate": 2}},
     "limits.max_rate: unknown key (allowed here: burst, max_in_flight, max_request_kb, max_streams, rate)"),
    ({"limits": 5}, "limits: must be a mapping of burst, max_in_flight, max_request_kb, max_streams, rate"),
    ({"quotas": {"users": {"bob": 3}}}, "quotas.users.bob: must be a mapping of max_concurrent_runs"),
])
def test_an_unknown_key_in_an_old_section_is_named(data, problem):
    with pytest.raises(LegacyKeyError) as err:
        migrate(data, CLUSTER_FILE)
    assert str(err.value).startswith(problem)
    assert str(err.value).endswith("is deprecated: its limits are in the `tenancy` section")


def test_an_invalid_old_value_is_named_by_both_keys(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"quotas": {"default": {"max_queued_runs": 0}}}))
    with pytest.raises(SpecError) as err:
        load_cluster_file(path)
    assert err.value.problems == [
        "tenancy.default_user.max_waiting_runs: Input should be greater than or equal to 1 (got 0)",
        "quotas.default.max_queued_runs: deprecated, read as tenancy.default_user.max_waiting_runs"]


def test_the_serve_apps_args_keep_their_old_keys_too():
    """A hand-written Serve config (KubeRay's RayService) passes the apps' args itself."""
    coordinator, moved = migrate({"max_queued_runs": 9, "max_concurrent_runs": 2, "spec_reading_share": 0.5,
                                  "quotas": {"default": {"max_concurrent_runs": 8}, "users": {}},
                                  "watch_max_s": 60}, COORDINATOR_ARGS)
    assert coordinator == {"watch_max_s": 60, "tenancy": {
        "cluster": {"queue_capacity": 9, "max_training_runs": 2}, "callers": {"spec_reading_share": 0.5},
        "default_user": {"max_unfinished_runs": 8}}}
    assert moved == {"quotas.default.max_concurrent_runs": "tenancy.default_user.max_unfinished_runs",
                     "max_concurrent_runs": "tenancy.cluster.max_training_runs",
                     "max_queued_runs": "tenancy.cluster.queue_capacity",
                     "spec_reading_share": "tenancy.callers.spec_reading_share"}
    gateway, moved = migrate({"port": 9000, "limits": {"max_streams": 3, "rate": 5}}, GATEWAY_ARGS)
    assert gateway == {"port": 9000, "tenancy": {"callers": {"max_streams": 3, "calls_per_s": 5}}}
    assert moved == {"limits.max_streams": "tenancy.callers.max_streams", "limits.rate": "tenancy.callers.calls_per_s"}
    assert migrate({"port": 9000, "tenancy": {}}, GATEWAY_ARGS) == ({"port": 9000, "tenancy": {}}, {})
