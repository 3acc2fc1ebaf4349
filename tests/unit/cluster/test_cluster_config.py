"""The cluster file and the Serve config derived from it."""

from __future__ import annotations

import pytest
import yaml

from rlserve.cluster.config import default_cluster_file, load_cluster_file
from rlserve.cluster.loopback import rewrite
from rlserve.cluster.serve_config import APPS, serve_config
from rlserve.config.errors import SpecError


def test_default_cluster_is_loopback_authenticated_and_complete(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    cfg, runs = load_cluster_file(default_cluster_file())
    assert cfg.loopback and cfg.address is None
    assert runs == tmp_path / "runs"  # not inside the installed package
    assert cfg.model_dirs == [str(tmp_path / "models")] and cfg.data_dirs == [str(tmp_path / "data")]
    config = serve_config(cfg, runs)
    assert config["proxy_location"] == "Disabled", "Serve's own proxies would be an unauthenticated way in"
    assert [a["name"] for a in config["applications"]] == list(APPS)
    apps = {a["name"]: a["args"] for a in config["applications"]}
    gateway = apps["gateway"]
    assert gateway["host"] == "127.0.0.1" and gateway["port"] == 9000
    assert gateway["auth"] == {"token_file": str(runs / ".cluster" / "token"),
                               "admin_token_file": str(runs / ".cluster" / "admin_token"),
                               "users_file": str(runs / ".cluster" / "users")}
    assert apps["coordinator"]["cluster_file"] == str(default_cluster_file().resolve())
    assert gateway["expose_internal"] is False and gateway["tls"] is None
    assert gateway["deployment"]["cpu_cores"] == []  # anywhere, unless the cluster file says otherwise
    assert apps["coordinator"]["paths"]["runs_dir"] == str(runs)
    assert apps["coordinator"]["allowed_plugins"] == [] == apps["reward"]["allowed_plugins"]
    for name in ("rollout", "reference", "learner", "coordinator"):
        assert all(Path(d).is_absolute() for d in apps[name]["paths"]["model_dirs"])


def test_auth_none_tls_and_relative_paths(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"auth": "none", "tls": {"cert_file": "c.pem", "key_file": "k.pem"},
                                    "reward": {"allowed_plugins": ["plug.py:f", "pkg.mod:g"]}}))
    cfg, runs = load_cluster_file(path)
    gateway = next(a["args"] for a in serve_config(cfg, runs)["applications"] if a["name"] == "gateway")
    assert gateway["auth"] is None
    assert gateway["tls"] == {"cert_file": str(tmp_path / "c.pem"), "key_file": str(tmp_path / "k.pem")}
    assert cfg.reward.allowed_plugins == [f"{tmp_path / 'plug.py'}:f", "pkg.mod:g"]


def test_the_tenancy_section_reaches_the_coordinator_and_the_gateway_with_the_file_that_holds_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"tenancy": {"default_user": {"max_waiting_runs": 3}, "users": {"bob": {
        "max_unfinished_runs": 1}}, "callers": {"max_streams": 4}, "cluster": {"max_training_runs": 2}}}))
    cfg, runs = load_cluster_file(path)
    apps = {a["name"]: a["args"] for a in serve_config(cfg, runs)["applications"]}
    expected = {"callers": {"max_streams": 4, "max_calls_in_flight": 32, "calls_per_s": 50.0, "call_burst": 100,
                            "max_request_kb": 512, "spec_reading_share": 0.1, "spec_reading_burst_s": 2.0,
                            "spec_reading_max_wait_s": 30.0},
                "default_user": {"max_unfinished_runs": 8, "max_waiting_runs": 3, "max_samples_per_run": 100_000_000,
                                 "max_priority": 1.0},
                "users": {"bob": {"max_unfinished_runs": 1}}, "cluster": {"max_training_runs": 2, "queue_capacity": 64}}
    assert apps["coordinator"]["tenancy"] == expected == apps["gateway"]["tenancy"]
    assert apps["coordinator"]["cluster_file"] == str(path)  # the coordinator re-reads its `tenancy` there
    path.write_text(yaml.safe_dump({"tenancy": {"users": {"Not A Name": {}}}}))
    with pytest.raises(SpecError, match="tenancy.users"):
        load_cluster_file(path)
    path.write_text(yaml.safe_dump({"tenancy": {"users": {"bob": {"max_runs": 1}}}}))
    with pytest.raises(SpecError) as err:
        load_cluster_file(path)
    assert err.value.problems[0].startswith("tenancy.users.bob.max_runs: unknown key")
    assert err.value.problems[0].endswith("(allowed here: max_priority, max_samples_per_run, max_unfinished_runs, "
                                          "max_waiting_runs)")


def test_the_default_cluster_file_gives_every_limit_its_default_and_no_old_key(tmp_path, monkeypatch):
    from rlserve.tenancy.policy import TenancyPolicy

    monkeypatch.chdir(tmp_path)
    cfg, _ = load_cluster_file(default_cluster_file())
    assert cfg.tenancy == TenancyPolicy() and cfg.deprecated_keys == {}
    written = yaml.safe_load(default_cluster_file().read_text())["tenancy"]
    assert TenancyPolicy.model_validate(written).model_dump() == written  # every key written out


@pytest.mark.parametrize("services, shared", [
    ({}, True),  # the default: every process may use every core
    ({"rollout": {"args": {"cpu_cores": [0]}}, "learner": {"cpu_cores": [1]}}, False),
    ({"rollout": {"args": {"cpu_cores": [0, 1]}}, "learner": {"cpu_cores": [1]}}, True),
    ({"rollout": {"cpu_cores": [0]}, "learner": {"cpu_cores": [1]}}, False),  # the transformers engine
    ({"rollout": {"num_gpus": 0.3}}, False),
    ({"rollout": {"resources": {"rollout_slot": 1}}}, False),  # on nodes of its own
])
def test_the_coordinator_knows_whether_generation_shares_the_learners_cores(tmp_path, services, shared):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"services": services}))
    cfg, runs = load_cluster_file(path)
    coordinator = next(a["args"] for a in serve_config(cfg, runs)["applications"] if a["name"] == "coordinator")
    assert coordinator["generation_shares_cpu_cores"] is shared


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
    assert config["proxy_location"] == "Disabled"
    gateway = next(a["args"] for a in config["applications"] if a["name"] == "gateway")
    assert gateway["auth"] is not None and gateway["expose_internal"] is False


def test_partial_service_section_keeps_that_services_defaults(tmp_path):
    from rlserve.cluster.config import DEFAULT_NUM_CPUS
    from rlserve.cluster.serve_config import GATEWAY_NUM_CPUS

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"services": {"rollout": {"args": {"engine": "transformers"}},
                                                 "reference": {"num_cpus": 1.5}}}))
    cfg, _ = load_cluster_file(path)
    assert cfg.services.rollout.num_cpus == DEFAULT_NUM_CPUS["rollout"] == 0.5
    assert cfg.services.reference.num_cpus == 1.5
    args = serve_config(cfg, tmp_path)["applications"]
    assert {a["name"]: a["args"]["deployment"]["num_cpus"] for a in args} == {**DEFAULT_NUM_CPUS, "reference": 1.5,
                                                                                 "gateway": GATEWAY_NUM_CPUS}


def test_kuberay_manifest_args_are_valid_for_each_app():
    """Each application's args in the manifest pass the app's own validation (as Serve would build it)."""
    import importlib
    from pathlib import Path

    from rlserve.cluster.deployment import DeploymentArgs

    manifest = yaml.safe_load(Path("deploy/kuberay/rayservice.yaml").read_text())
    for app in yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]:
        module = importlib.import_module(app["import_path"].split(":")[0])
        args = dict(app["args"])
        DeploymentArgs.model_validate(args.pop("deployment"))
        args_cls = next(v for k, v in vars(module).items() if k.endswith("Args") and k != "DeploymentArgs"
                        and getattr(v, "__module__", "") == module.__name__)
        assert getattr(args_cls.model_validate(args), "deprecated_keys", {}) == {}, app["name"]  # `tenancy` only


def test_a_local_head_and_its_drivers_share_token_auth_with_the_clusters_own_token(tmp_path):
    from rlserve.cluster.config import ClusterFile
    from rlserve.cluster.lifecycle import Cluster, ensure_ray_token

    cluster = Cluster(ClusterFile(), tmp_path / "runs")
    env = cluster.env()
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "runs" / ".cluster" / "ray_token")
    ensure_ray_token(cluster)
    token = cluster.ray_token_file
    assert len(token.read_text()) == 64 and (token.stat().st_mode & 0o777) == 0o600
    ensure_ray_token(cluster)  # kept, not replaced
    # An existing cluster keeps its own authentication settings.
    assert "RAY_AUTH_MODE" not in Cluster(ClusterFile(address="10.0.0.5:6379"), tmp_path).env()


def test_the_control_plane_can_have_cores_of_its_own(tmp_path):
    """The gateway pins itself (`place_from_env`) to the cluster file's `gateway_cpu_cores`, as each service
    does to its `services.<name>.cpu_cores`."""
    from ray import serve

    from rlserve import cpu_affinity
    from rlserve.cluster.deployment import DeploymentArgs

    @serve.deployment
    class Gateway:  # the options a deployment gets do not depend on its body
        pass

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"gateway_cpu_cores": [0], "services": {"coordinator": {"cpu_cores": [0]},
                                                                            "learner": {"cpu_cores": [1]}}}))
    cfg, runs = load_cluster_file(path)
    apps = {a["name"]: a["args"] for a in serve_config(cfg, runs)["applications"]}
    assert apps["gateway"]["deployment"]["cpu_cores"] == [0] == apps["coordinator"]["deployment"]["cpu_cores"]
    options = DeploymentArgs(**apps["gateway"]["deployment"]).apply(Gateway).ray_actor_options
    assert options["runtime_env"]["env_vars"][cpu_affinity.ENV] == "0"
    path.write_text(yaml.safe_dump({"gateway_cpu_cores": [-1]}))
    with pytest.raises(SpecError, match="gateway_cpu_cores"):
        load_cluster_file(path)
