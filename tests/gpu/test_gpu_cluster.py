"""GPU-only: the whole system on one GPU through `deploy/serve up` and `rlserve submit`, as a user runs it
(examples/cluster_gpu_one.yaml on other ports, with the internal services exposed to the admin token; a
3-step run of examples/grpo_addition_gpu.yaml without its SFT warm start, on each learner backend). Checks
that the cluster comes up, the runs succeed, new weights reach the rollout by the same-GPU handoff and
what the engine serves afterwards is bit for bit the learner's final policy, and the replicas that asked
for a GPU fraction hold memory on the GPU while those that did not hold none. Skipped without CUDA, and
without Ray (a GPU machine before the offline bundle is installed: docs/operations.md, "Offline install")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from rlserve.dtypes import torch_dtype
from rlserve.security.tokens import read_tokens
from rlserve.v1 import rollout_pb2, rollout_pb2_grpc
from rlserve.weights.digest import differences, folder_digests

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
RAY_PORT, GRPC_PORT = 6680, 9180


def _env() -> dict[str, str]:
    env = {**os.environ, "RLSERVE_ENDPOINT": f"127.0.0.1:{GRPC_PORT}", "PYTHONUNBUFFERED": "1"}
    if not (ROOT / ".venv" / "bin" / "python").exists():
        env.setdefault("RLSERVE_PYTHON", sys.executable)
    return env


def _run(*cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=ROOT)


def _gpu_processes() -> dict[str, int]:
    """Process name -> MiB it holds on the GPU (nvidia-smi names Ray's actors by their titles)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=process_name,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.rsplit(",", 1) for line in out.strip().splitlines() if "," in line]
    return {name.strip(): int(mib) for name, mib in rows}


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    pytest.importorskip("ray", reason="Ray is not installed (install the offline bundle)")
    tmp = tmp_path_factory.mktemp("gpu-cluster")
    cfg = yaml.safe_load((ROOT / "examples" / "cluster_gpu_one.yaml").read_text())
    cfg.update(ray_port=RAY_PORT, grpc_port=GRPC_PORT, http_port=GRPC_PORT + 1, runs_dir=str(tmp / "runs"),
               expose_internal=True)
    cluster_file = tmp / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(cfg))
    up = _run("deploy/serve", "up", str(cluster_file), timeout=600)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield cluster_file, tmp / "runs"
    finally:
        _run("deploy/serve", "down", str(cluster_file), timeout=300)


def test_replicas_that_asked_for_a_gpu_fraction_run_on_it(gpu_cluster):
    held = _gpu_processes()
    on_gpu = {name for name, mib in held.items() if mib > 0}
    for replica in ("ServeReplica:rollout:Rollout", "ServeReplica:reference:Reference"):
        assert any(replica in name for name in on_gpu), f"{replica} holds no GPU memory: {held}"
    for replica in ("Coordinator", "Reward", "Gateway", "ServeReplica:learner:Learner"):
        assert not any(replica in name for name in on_gpu), f"{replica} (num_gpus 0) is on the GPU: {held}"


def _served_weights(cluster_file: Path) -> rollout_pb2.GetInfoResponse:
    """The rollout replica's weights by digest, asked through the gateway with the admin token."""
    admin = _run("deploy/serve", "token", str(cluster_file), "--admin", timeout=120)
    assert admin.returncode == 0, admin.stderr
    token = read_tokens(Path(admin.stdout.strip()))[0]
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        return rollout_pb2_grpc.RolloutStub(channel).GetInfo(
            rollout_pb2.GetInfoRequest(weight_digests=True), metadata=(("authorization", f"Bearer {token}"),),
            timeout=300)


@pytest.mark.parametrize("backend", ["dtensor", "megatron"])
def test_a_three_step_run_trains_on_the_gpu(gpu_cluster, tmp_path, backend):
    spec = yaml.safe_load((ROOT / "examples" / "grpo_addition_gpu.yaml").read_text())
    spec["sft"] = {"enabled": False}
    # Without the warm start the random model scores 0 on exact answers, every group ties and nothing trains:
    # per-character partial credit gives groups a spread.
    spec["reward"] = {"functions": [{"name": "exact_match", "args": {"partial_credit": True}}]}
    spec["grpo"].update(max_num_steps=3, val_period=3, max_val_samples=32, num_prompts_per_step=16)
    spec["policy"]["train_global_batch_size"] = spec["policy"]["train_micro_batch_size"] = 128
    if backend == "megatron":
        spec["policy"]["megatron_cfg"] = {"enabled": True}
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    run = _run("deploy/rlserve", "submit", str(spec_file), "--watch", timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    cluster_file, runs_dir = gpu_cluster
    run_dir = max((p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                  key=lambda p: p.stat().st_mtime)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["state"] == "succeeded", events[-1]
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert any(f"{backend} backend" in e["message"] and "on cuda" in e["message"] for e in events), \
        f"the learner did not report the {backend} backend on a CUDA device"
    assert all(e["metrics"]["timing/train_s"] > 0 for e in steps)
    # The cluster file's rollout takes weights by CUDA IPC (`weight_transfer: ipc`): from the session's
    # second version on they are handed over on the GPU, and the engine loads nothing from the store.
    later = steps[1:]
    assert all(e["metrics"]["weight_sync/direct_mib"] > 0 for e in later), [e["metrics"] for e in later]
    assert all(e["metrics"]["weight_sync/store_fetch_mib"] == 0 for e in later)
    # What the engine serves after the last handoff is bit for bit the learner's final policy (in the
    # engine's dtype): no tensor rounded, reordered or left behind on the way.
    served = _served_weights(cluster_file)
    expected = folder_digests(run_dir / "final_model", torch_dtype(served.dtype))
    assert served.weight_sha256 and not differences(expected, dict(served.weight_sha256)), \
        differences(expected, dict(served.weight_sha256))[:10]
