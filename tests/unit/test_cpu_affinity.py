"""Separate CPU shares: a service's `cpu_cores` pin its replicas (every thread, and what they start),
and the rollout engine's `cpu_cores` pin only the processes it starts. Real processes, real affinity."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import yaml

from rlserve import cpu_affinity
from rlserve.cluster.config import load_cluster_file
from rlserve.cluster.deployment import DeploymentArgs
from rlserve.cluster.serve_config import serve_config

needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")

CHILD_AFFINITY = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]


def thread_affinities() -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


@needs_two_cores
def test_a_pinned_replica_pins_every_thread_and_what_it_starts():
    script = (
        "import os, subprocess, sys, threading, time\n"
        "from rlserve import cpu_affinity\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"  # a thread from before
        "cpu_affinity.place_from_env()\n"
        "print(sorted({frozenset(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}, key=len))\n"
        f"print(subprocess.run({CHILD_AFFINITY!r}, capture_output=True, text=True).stdout.strip())\n")
    env = {**os.environ, cpu_affinity.ENV: "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    threads, child = out.stdout.splitlines()
    assert threads == "[frozenset({1})]" and child == "[1]"


@needs_two_cores
def test_processes_started_inside_children_on_run_on_its_cores_and_the_caller_keeps_its_own():
    before = thread_affinities()
    started = []
    with cpu_affinity.children_on([0], "cpu_cores"):
        child = subprocess.run(CHILD_AFFINITY, capture_output=True, text=True, check=True).stdout.strip()
        thread = threading.Thread(target=started.append, args=(1,))  # a thread started meanwhile
        thread.start()
        thread.join()
        helper = threading.Thread(target=threading.Event().wait, args=(2,), daemon=True)
        helper.start()
    assert child == "[0]"
    assert thread_affinities() == before  # this thread and the helper are back on every core


def test_a_niced_replica_lowers_every_threads_priority_and_what_it_starts_inherits_it():
    script = (
        "import os, subprocess, sys, threading, time\n"
        "from rlserve import cpu_affinity\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"  # a thread from before
        "cpu_affinity.place_from_env()\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}))\n"
        "print(subprocess.run([sys.executable, '-c', 'import os; print(os.getpriority(os.PRIO_PROCESS, 0))'],"
        " capture_output=True, text=True).stdout.strip())\n")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    env = {**os.environ, cpu_affinity.NICE_ENV: str(base + 5)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    threads, child = out.stdout.splitlines()
    assert threads == f"[{base + 5}]" and child == str(base + 5)


def test_compute_services_run_niced_by_default_and_the_control_plane_does_not(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"services": {"reference": {"nice": 3}}}))
    cfg, _ = load_cluster_file(path)
    deployments = {a["name"]: a["args"]["deployment"] for a in serve_config(cfg, tmp_path)["applications"]}
    assert {name: d.get("nice", 0) for name, d in deployments.items()} == {
        "rollout": 10, "reward": 0, "reference": 3, "learner": 10, "coordinator": 0, "gateway": 0}
    env = DeploymentArgs.model_validate(deployments["rollout"]).apply(_Probe()).options_seen["ray_actor_options"]
    assert env["runtime_env"]["env_vars"][cpu_affinity.NICE_ENV] == "10"
    assert "runtime_env" not in DeploymentArgs.model_validate(deployments["coordinator"]).apply(
        _Probe()).options_seen["ray_actor_options"]


class _Probe:
    """Stands in for a serve.Deployment: records what `DeploymentArgs.apply` sets (no Ray needed to read it)."""

    def options(self, **kwargs) -> _Probe:
        self.options_seen = kwargs
        return self


def test_cores_the_machine_lacks_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^services\.learner\.cpu_cores: cores \[4096\] do not exist"):
        cpu_affinity.check_cores([0, 4096], "services.learner.cpu_cores")


def test_cluster_file_cpu_cores_reach_each_replica(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"services": {"learner": {"cpu_cores": [1]},
                                                 "rollout": {"args": {"cpu_cores": [0]}}}}))
    cfg, runs = load_cluster_file(path)
    apps = {a["name"]: a["args"] for a in serve_config(cfg, runs)["applications"]}
    assert apps["learner"]["deployment"]["cpu_cores"] == [1]
    assert apps["rollout"]["deployment"]["cpu_cores"] == [] and apps["rollout"]["cpu_cores"] == [0]
    from ray import serve

    @serve.deployment
    class Probe:
        pass

    options = DeploymentArgs.model_validate(apps["learner"]["deployment"]).apply(Probe).ray_actor_options
    assert options["runtime_env"]["env_vars"][cpu_affinity.ENV] == "1"
    path.write_text(yaml.safe_dump({"services": {"learner": {"cpu_cores": [-1]}}}))
    with pytest.raises(Exception, match=r"services\.learner\.cpu_cores"):
        load_cluster_file(path)


def test_the_cpu_split_example_pins_the_engine_apart_from_everything_else():
    from pathlib import Path

    from rlserve.rollout.interfaces import EngineSettings

    cfg, runs = load_cluster_file(Path("examples/cluster_cpu_split.yaml"))
    apps = {a["name"]: a["args"] for a in serve_config(cfg, runs)["applications"]}
    engine = EngineSettings.model_validate({k: v for k, v in apps["rollout"].items() if k in EngineSettings.model_fields})
    assert engine.cpu_cores == (0,) and engine.in_flight_kv_cache == "keep"
    assert {name: args["deployment"]["cpu_cores"] for name, args in apps.items() if name != "gateway"} == \
        {"rollout": [1], "reward": [1], "reference": [1], "learner": [1], "coordinator": [1]}
