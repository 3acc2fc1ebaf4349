"""The coordinator's deploy arguments: the retry policy is configured in one place, unknown keys are refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.coordinator.app import CoordinatorArgs


def test_retry_policy_is_configured_in_one_place():
    args = CoordinatorArgs.model_validate({"retry": {"retries": 3}})
    assert args.retry.retries == 3 and args.retry.timeout_s == CoordinatorArgs().retry.timeout_s
    with pytest.raises(ValidationError):
        CoordinatorArgs.model_validate({"call_retries": 3})


def test_the_cluster_files_tenancy_reaches_the_coordinator(tmp_path):
    import yaml

    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.serve_config import serve_config

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"tenancy": {"users": {"alice": {"max_waiting_runs": 2}}}}))
    cfg, runs = load_cluster_file(path)
    app = next(a for a in serve_config(cfg, runs)["applications"] if a["name"] == "coordinator")
    args = CoordinatorArgs.model_validate({k: v for k, v in app["args"].items() if k != "deployment"})
    assert args.tenancy.users["alice"].max_waiting_runs == 2 and args.cluster_file == str(path)
    assert args.deprecated_keys == {}


def test_old_limit_args_still_work_and_are_named_with_their_new_keys_at_start():
    """A hand-written Serve config (KubeRay's RayService) passes these args itself; the replica logs each old one
    (`rlserve.tenancy.legacy.log_deprecated`), also after the builder's validate-and-dump."""
    args = CoordinatorArgs.model_validate({"max_queued_runs": 9, "max_concurrent_runs": 2, "spec_reading_share": 0.5,
                                           "quotas": {"default": {"max_concurrent_runs": 3}, "users": {}}})
    again = CoordinatorArgs.model_validate(args.model_dump())
    for a in (args, again):
        assert (a.tenancy.cluster.queue_capacity, a.tenancy.cluster.max_training_runs) == (9, 2)
        assert (a.tenancy.callers.spec_reading_share, a.tenancy.default_user.max_unfinished_runs) == (0.5, 3)
        assert a.deprecated_keys == {"quotas.default.max_concurrent_runs": "tenancy.default_user.max_unfinished_runs",
                                     "max_concurrent_runs": "tenancy.cluster.max_training_runs",
                                     "max_queued_runs": "tenancy.cluster.queue_capacity",
                                     "spec_reading_share": "tenancy.callers.spec_reading_share"}
    with pytest.raises(ValidationError, match="max_queued_runs: deprecated, and tenancy.cluster.queue_capacity"):
        CoordinatorArgs.model_validate({"max_queued_runs": 9, "tenancy": {"cluster": {"queue_capacity": 8}}})
