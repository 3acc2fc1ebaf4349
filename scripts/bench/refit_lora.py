"""Refit with LoRA against full weights: what travels from the learner to every rollout engine per step.

One local cluster per preset (`small`, 29M parameters; `medium`, 101M) with the learner and two
vLLM rollout replicas started with LoRA serving on (fp32). Two learner sessions take turns, each
version timed from `ExportWeights` until both replicas serve it:
  - full: every weight, sent straight to both engines through vLLM's weight-transfer API (the gloo
    engine) plus the store copy, the way full-parameter runs refit;
  - lora: the adapter (rank `--rank`, default 16) of every linear layer of attention and MLP, through the weight store
    (each replica writes it as a PEFT folder in /dev/shm and vLLM loads it in place).
Prints a table (seconds and bytes, and LoRA's share of full) and writes bench-results/refit_lora.json.

    .venv/bin/python scripts/bench/refit_lora.py [--presets small medium] [--repeats 3] [--rank 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402
from scripts.bench.refit import REPLICAS, bench_cluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["small", "medium"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    import grpc
    import yaml

    from rlserve.cluster.lifecycle import _serve_start, connect, deploy, down, prepare_auth, serve_config, start_head
    from rlserve.security.tokens import read_tokens
    from rlserve.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
    rows = []
    for preset in args.presets:
        cluster = bench_cluster(root, preset, 6880, {"enable_lora": True, "max_lora_rank": args.rank})
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
            md = (("authorization", f"Bearer {read_tokens(cluster.token_files[1])[0]}"),)
            batch = [learner_pb2.TrainSequence(token_ids=[5, 6, 7, 8, 9, 10], prompt_length=3)] * 2

            def spec(lora: bool) -> str:
                policy = {"model_name": f"preset:{preset}", "max_total_sequence_length": 16,
                          "generation": {"max_new_tokens": 8}}
                if lora:
                    policy["dtensor_cfg"] = {"lora_cfg": {"enabled": True, "dim": args.rank}}
                return yaml.safe_dump({"policy": policy})

            def wait_all(version: int) -> None:
                deadline = time.time() + 600
                while True:
                    seen = {}
                    for _ in range(8 * REPLICAS):
                        got = rollout.GetInfo(rollout_pb2.GetInfoRequest(), metadata=md)
                        seen[got.replica_id] = got.weight_version
                    if len(seen) == REPLICAS and set(seen.values()) == {version}:
                        return
                    assert time.time() < deadline, seen
                    time.sleep(0.005)

            def refit(run: str) -> tuple[float, learner_pb2.ExportWeightsResponse]:
                step = learner.TrainStep(learner_pb2.TrainStepRequest(
                    run_id=run, loss_name="sft", sequences=batch, learning_rate=1e-4), metadata=md)
                t0 = time.perf_counter()
                out = learner.ExportWeights(learner_pb2.ExportWeightsRequest(run_id=run, direct=True, in_flight=True),
                                            metadata=md, timeout=900)
                wait_all(step.weight_version)
                return time.perf_counter() - t0, out

            samples = {"full": [], "lora": []}
            for _ in range(args.repeats):
                for mode in ("full", "lora"):  # alternating sessions: drifts in machine load hit both alike
                    run = f"bench-{mode}"
                    learner.Configure(learner_pb2.ConfigureRequest(run_id=run, spec_yaml=spec(mode == "lora")),
                                      metadata=md)
                    refit(run)  # the session's first version: learns the export order (the direct path's)
                    samples[mode].append(refit(run))
            full_s = statistics.median(s for s, _ in samples["full"])
            for mode, values in samples.items():
                seconds = statistics.median(s for s, _ in values)
                out = values[-1][1]
                rows.append({"preset": preset, "mode": mode, "refit_s": seconds, "mib_sent": out.num_bytes / 2**20,
                             "model_mib": out.model_bytes / 2**20, "bytes_share": out.num_bytes / out.model_bytes,
                             "direct_mib": out.direct_bytes / 2**20, "time_vs_full": seconds / full_s})
            channel.close()
        finally:
            down(cluster)
    print(table(rows, ["preset", "mode", "refit_s", "time_vs_full", "mib_sent", "model_mib", "bytes_share",
                       "direct_mib"]))
    print("wrote", record("refit_lora", rows, {"repeats": args.repeats, "rank": args.rank, "replicas": REPLICAS}))


if __name__ == "__main__":
    main()
