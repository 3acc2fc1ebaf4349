"""Refit benchmark: a new policy version from the learner into every rollout engine, direct vs object store.

One local cluster per preset (`small`, 29M parameters; `medium`, 101M) with the learner and two
rollout replicas (vLLM, fp32). Per version, interleaved:
  - direct: `ExportWeights(direct=True)`: learner rank 0 sends each tensor to both engines through
    vLLM's weight-transfer API (the gloo engine), keeps one copy in the weight store, returns when
    both engines serve it;
  - object store: `ExportWeights(direct=False)`: the learner puts the buckets in the object store;
    each replica fetches them, hands them to its engine as a /dev/shm safetensors folder and loads;
    timed until both replicas report the version.
Also measured in the same run: memcpy bandwidth of this process (one model-sized tensor copy),
and the learner process's peak resident memory above its level before the export (sampled every
2 ms): the direct path never holds the model, only buckets. Prints a table and writes
bench-results/refit.json.

    .venv/bin/python scripts/bench/refit.py [--presets small medium] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402

RUN = "bench-refit"
BUCKET_MB = 64
REPLICAS = 2


def bench_cluster(root: Path, preset: str, port_base: int, rollout_args: dict | None = None):
    import yaml

    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster

    # The gateway serves the learner and rollout services to the admin token (internal RPCs, exposed here).
    data = {"name": f"bench-refit-{preset}", "ray_port": port_base, "grpc_port": port_base + 10,
            "expose_internal": True, "num_cpus": 4, "object_store_memory_mb": 2048,
            "runs_dir": str(root / "runs"),
            "services": {"rollout": {"replicas": REPLICAS, "num_cpus": 0.5,
                                     "args": {"engine": "vllm", "model": f"preset:{preset}", "max_model_len": 128,
                                              **(rollout_args or {})}},
                         "learner": {"num_cpus": 0.1}}}
    path = root / f"{preset}.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, runs = load_cluster_file(path)
    return Cluster(cfg, runs)


class PeakRss:
    """Peak resident memory of one process above its level at start, sampled every 2 ms."""

    def __init__(self, pid: int):
        import psutil

        self.proc = psutil.Process(pid)
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def learner_worker_pid() -> int:
    import psutil

    pids = [p.pid for p in psutil.process_iter(["cmdline"]) if any("LearnerWorker" in c for c in p.info["cmdline"] or [])]
    assert len(pids) == 1, f"expected one learner worker process, found {pids}"
    return pids[0]


def memcpy_gbps(nbytes: int) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["small", "medium"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import grpc
    import yaml

    from rlserve.cluster.lifecycle import _serve_start, connect, deploy, down, prepare_auth, serve_config, start_head
    from rlserve.security.tokens import read_tokens
    from rlserve.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
    rows = []
    for preset in args.presets:
        cluster = bench_cluster(root, preset, 6880)
        start_head(cluster)
        try:
            connect(cluster)
            config = serve_config(cluster.cfg, cluster.runs_dir)
            config["applications"] = [a for a in config["applications"] if a["name"] in ("rollout", "learner", "gateway")]
            prepare_auth(cluster)
            _serve_start(cluster, config)
            deploy(cluster, config)
            channel = grpc.insecure_channel(cluster.grpc_endpoint)
            learner = learner_pb2_grpc.LearnerStub(channel)
            rollout = rollout_pb2_grpc.RolloutStub(channel)
            admin = (("authorization", f"Bearer {read_tokens(cluster.token_files[1])[0]}"),)
            md = {"learner": admin, "rollout": admin}
            spec = yaml.safe_dump({"policy": {"model_name": f"preset:{preset}", "refit_buffer_size_mb": BUCKET_MB,
                                              "max_total_sequence_length": 16,
                                              "generation": {"max_new_tokens": 8}}})
            info = learner.Configure(learner_pb2.ConfigureRequest(run_id=RUN, spec_yaml=spec), metadata=md["learner"])
            pid = learner_worker_pid()
            batch = [learner_pb2.TrainSequence(token_ids=[5, 6, 7, 8, 9, 10], prompt_length=3)] * 2

            def versions() -> dict[str, int]:
                seen = {}
                for _ in range(8 * REPLICAS):
                    got = rollout.GetInfo(rollout_pb2.GetInfoRequest(), metadata=md["rollout"])
                    seen[got.replica_id] = got.weight_version
                return seen

            def wait_all(version: int) -> None:
                deadline = time.time() + 600
                while True:
                    seen = versions()
                    if len(seen) == REPLICAS and set(seen.values()) == {version}:
                        return
                    assert time.time() < deadline, seen
                    time.sleep(0.005)

            def export(direct: bool) -> tuple[float, learner_pb2.ExportWeightsResponse, int]:
                step = learner.TrainStep(learner_pb2.TrainStepRequest(
                    run_id=RUN, loss_name="sft", sequences=batch, learning_rate=1e-4),
                    metadata=md["learner"])
                rss = PeakRss(pid)
                t0 = time.perf_counter()
                out = learner.ExportWeights(learner_pb2.ExportWeightsRequest(run_id=RUN, direct=direct, in_flight=True),
                                            metadata=md["learner"], timeout=900)
                if not direct:
                    wait_all(step.weight_version)
                seconds = time.perf_counter() - t0
                peak = rss.stop()
                assert not direct or (out.receivers == REPLICAS and not out.failed), out
                return seconds, out, peak

            export(direct=False)  # the session's first version: learns the export order, warms both paths
            export(direct=True)
            samples = {"direct": [], "object store": []}
            for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both alike
                samples["direct"].append(export(direct=True))
                samples["object store"].append(export(direct=False))
            model_bytes = samples["direct"][0][1].num_bytes
            bandwidth = memcpy_gbps(model_bytes)
            for path, values in samples.items():
                seconds = statistics.median(s for s, _, _ in values)
                out = values[-1][1]
                rows.append({
                    "preset": preset, "params_m": info.num_parameters / 1e6, "model_mb": model_bytes / 2**20,
                    "path": path, "refit_s": seconds, "replicas": REPLICAS,
                    "direct_mb": out.direct_bytes / 2**20, "store_copy_mb": out.num_bytes / 2**20,
                    "learner_peak_mb": statistics.median(p for _, _, p in values) / 2**20,
                    "gb_per_s": model_bytes * REPLICAS / seconds / 1e9, "memcpy_gb_per_s": bandwidth,
                    "refit_vs_memcpy": seconds / (model_bytes * REPLICAS / (bandwidth * 1e9))})
            channel.close()
        finally:
            down(cluster)
    print(table(rows, ["preset", "params_m", "model_mb", "path", "refit_s", "direct_mb", "store_copy_mb",
                       "learner_peak_mb", "gb_per_s", "memcpy_gb_per_s", "refit_vs_memcpy"]))
    print("wrote", record("refit", rows, {"repeats": args.repeats, "bucket_mb": BUCKET_MB, "replicas": REPLICAS}))


if __name__ == "__main__":
    main()
