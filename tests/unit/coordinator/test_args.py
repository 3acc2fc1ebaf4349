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


def test_the_cluster_files_quotas_reach_the_coordinator(tmp_path):
    import yaml

    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.serve_config import serve_config

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"quotas": {"users": {"alice": {"max_queued_runs": 2}}}}))
    cfg, runs = load_cluster_file(path)
    app = next(a for a in serve_config(cfg, runs)["applications"] if a["name"] == "coordinator")
    args = CoordinatorArgs.model_validate({k: v for k, v in app["args"].items() if k != "deployment"})
    assert args.quotas.users["alice"].max_queued_runs == 2 and args.cluster_file == str(path)
