"""GPU memory a user can plan: declared needs against the card, refused before `up` starts anything; the CUDA
allocator's settings for the services that use a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from rlserve.cluster import gpu_memory, lifecycle
from rlserve.cluster.config import load_cluster_file
from rlserve.cluster.gpu_memory import Card, GpuLayoutError, Need, worst_gpu
from rlserve.cluster.serve_config import CUDA_ALLOC_CONF_ENV, app_args

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
H100 = Card(79.2, "NVIDIA H100 80GB HBM3")


def _cluster(tmp_path, services: dict, **top):
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"num_gpus": 1, **top, "services": services}))
    return load_cluster_file(tmp_path / "cluster.yaml")


def test_services_that_may_share_one_gpu_must_fit_its_memory_and_are_named_when_they_do_not(tmp_path):
    cfg, _ = _cluster(tmp_path, {"rollout": {"num_gpus": 0.3, "gpu_memory_gib": 40, "args": {"engine": "transformers"}},
                                 "reference": {"num_gpus": 0.1, "gpu_memory_gib": 13},
                                 "learner": {"gpu_memory_gib": 45}})
    with pytest.raises(GpuLayoutError) as err:
        gpu_memory.check(cfg, H100)
    message = str(err.value)
    assert "rollout 40 + reference 13 + learner 45 = 98 GiB" in message and "79.2 GiB (NVIDIA H100 80GB HBM3)" in message
    assert "nothing was started" in message
    # On a card that holds them, the plan is shown.
    assert gpu_memory.check(cfg, Card(141.0, "H200")) == [
        "GPU memory plan: rollout 40 + reference 13 + learner 45 = 98 of 141.0 GiB on one GPU (H200)"]


def test_the_worst_gpu_is_the_heaviest_set_whose_fractions_fit_on_one():
    rollout, reference = Need("rollout", 30, 0.5, 2), Need("reference", 20, 0.6, 1)
    # Two rollouts (0.5 + 0.5) fit one GPU together; a rollout and the reference (1.1) do not.
    assert worst_gpu([rollout, reference]) == (60, ["rollout", "rollout"])
    # A replica of whole GPUs holds them alone; the learner's workers may be on any GPU.
    assert worst_gpu([Need("rollout", 70, 1, 1), Need("learner", 30, 0, 1)]) == (70, ["rollout"])
    assert worst_gpu([Need("rollout", 50, 0.4, 1), Need("learner", 30, 0, 1)]) == (80, ["rollout", "learner"])


def test_the_card_size_comes_from_the_cluster_file_before_any_gpu_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_memory, "read_card", lambda: pytest.fail("the cluster file gave the card's size"))
    cfg, _ = _cluster(tmp_path, {"rollout": {"num_gpus": 0.5, "gpu_memory_gib": 50}, "learner": {"gpu_memory_gib": 40}},
                      gpu_card_gib=79.2)
    with pytest.raises(GpuLayoutError, match=r"rollout 50 \+ learner 40 = 90 GiB .* 79.2 GiB \(gpu_card_gib\)"):
        gpu_memory.check(cfg)


def test_no_declared_need_reads_no_gpu_and_a_machine_without_one_skips_the_check(tmp_path, monkeypatch):
    cfg, _ = _cluster(tmp_path, {"rollout": {"num_gpus": 0.5}})
    monkeypatch.setattr(gpu_memory, "read_card", lambda: pytest.fail("nothing declared: no GPU to read"))
    assert gpu_memory.check(cfg) == ["GPU memory not declared for rollout (services.<name>.gpu_memory_gib): "
                                     "not checked against the card"]
    cfg, _ = _cluster(tmp_path, {"rollout": {"num_gpus": 0.5, "gpu_memory_gib": 500}})
    monkeypatch.setattr(gpu_memory, "read_card", lambda: None)
    assert "are not checked" in gpu_memory.check(cfg)[0]


def test_this_machine_has_no_gpu_to_read():
    assert gpu_memory.read_card() is None  # CPU-only torch: the probe answers no card (CI has no GPU)


def test_up_refuses_the_layout_before_it_starts_anything(tmp_path, monkeypatch):
    cfg, runs_dir = _cluster(tmp_path, {"rollout": {"num_gpus": 0.3, "gpu_memory_gib": 60},
                                        "learner": {"gpu_memory_gib": 45}}, gpu_card_gib=79.2)
    started = []
    monkeypatch.setattr(lifecycle, "prepare_auth", lambda c: started.append("auth") or [])
    monkeypatch.setattr(lifecycle, "start_head", lambda c: started.append("head"))
    with pytest.raises(GpuLayoutError, match="rollout 60 . learner 45 = 105 GiB"):
        lifecycle.up(lifecycle.Cluster(cfg, runs_dir))
    assert started == [] and not (runs_dir / ".cluster").exists()


def test_deploy_serve_up_says_which_services_do_not_fit(tmp_path, capsys, monkeypatch):
    from rlserve.cluster.cli import main

    monkeypatch.setattr(os, "environ", os.environ.copy())  # the cluster's Ray settings stay in this test

    _cluster(tmp_path, {"rollout": {"num_gpus": 0.3, "gpu_memory_gib": 60}, "reference": {"num_gpus": 0.1,
             "gpu_memory_gib": 13}, "learner": {"gpu_memory_gib": 45}}, gpu_card_gib=79.2)
    assert main(["up", str(tmp_path / "cluster.yaml")]) == 1
    assert "rollout 60 + reference 13 + learner 45 = 118 GiB may share one GPU" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("cluster_gpu_*.yaml")), ids=lambda p: p.name)
def test_every_gpu_example_declares_its_services_needs_and_fits_an_80_gb_card(path):
    cfg, _ = load_cluster_file(path)
    needs, undeclared = gpu_memory.declared(cfg)
    assert undeclared == [] and "learner" in {n.service for n in needs}
    assert gpu_memory.check(cfg, H100)[0].startswith("GPU memory plan: ")
    assert cfg.services.rollout.args["engine"] == "auto"  # vLLM where it runs, else transformers


def test_the_allocator_settings_reach_the_services_that_use_a_gpu_and_theirs_win(tmp_path):
    cfg, runs_dir = _cluster(tmp_path, {"rollout": {"num_gpus": 0.3, "env_vars": {CUDA_ALLOC_CONF_ENV: "mine"}},
                                        "reference": {"num_gpus": 0.1}, "learner": {"gpu_memory_gib": 40}})
    env = {name: app_args(cfg, name, runs_dir)["deployment"]["env_vars"] for name in ("rollout", "reference", "learner",
                                                                                       "reward", "coordinator")}
    assert env["rollout"][CUDA_ALLOC_CONF_ENV] == "mine"
    assert env["reference"][CUDA_ALLOC_CONF_ENV] == env["learner"][CUDA_ALLOC_CONF_ENV] == "expandable_segments:True"
    assert CUDA_ALLOC_CONF_ENV not in env["reward"] and CUDA_ALLOC_CONF_ENV not in env["coordinator"]
    cfg, runs_dir = _cluster(tmp_path, {"reference": {"num_gpus": 0.1}}, cuda_alloc_conf="")
    assert CUDA_ALLOC_CONF_ENV not in app_args(cfg, "reference", runs_dir)["deployment"]["env_vars"]


def test_a_rollout_that_may_run_vllm_counts_the_share_of_the_card_vllm_takes(tmp_path):
    services = {"rollout": {"num_gpus": 0.3, "gpu_memory_gib": 20,
                            "args": {"engine": "auto", "gpu_memory_utilization": 0.27}},
                "learner": {"gpu_memory_gib": 42}}
    cfg, _ = _cluster(tmp_path, services)
    assert gpu_memory.check(cfg, H100)[0].startswith("GPU memory plan: rollout 21.4 + learner 42 = 63.4 of 79.2")
    assert gpu_memory.check(cfg, Card(139.8, "H200"))[0].startswith("GPU memory plan: rollout 37.7 + learner 42")
    services["rollout"]["args"] = {"engine": "vllm"}  # vLLM's default share: half the card
    cfg, _ = _cluster(tmp_path, services)
    with pytest.raises(GpuLayoutError, match=r"rollout 39.6 \+ learner 42 = 81.6 GiB"):
        gpu_memory.check(cfg, H100)
    services["rollout"]["args"] = {"engine": "transformers"}
    cfg, _ = _cluster(tmp_path, services)
    assert gpu_memory.check(cfg, H100)[0].startswith("GPU memory plan: rollout 20 + learner 42")
