"""Rollout benchmark, all in one run on the same prompts:
  - vLLM engine in this process vs the same engine behind the rollout service (gRPC through the
    gateway, with the admin token, and a Serve handle): the ratio is the service's overhead;
  - vLLM vs the transformers engine.
For the `tiny` and `small` presets. Prints a table and writes bench-results/rollout.json.

    .venv/bin/python scripts/bench/rollout.py [--presets tiny small] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table, timed  # noqa: E402

PROMPTS, SAMPLES, NEW_TOKENS = 64, 8, 16


def prompts(n: int) -> list[list[int]]:
    from rlserve.data.tasks import get_task
    from rlserve.models.tokenizer import build_tokenizer

    tok, task, rng = build_tokenizer(), get_task("addition", {}), random.Random(0)
    return [tok.encode(task.example(rng).prompt).ids for _ in range(n)]


def bench_cluster(root: Path, preset: str, port_base: int):
    import yaml

    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster

    # The gateway serves the rollout service to the admin token (an internal RPC, exposed for this bench).
    data = {"name": f"bench-{preset}", "ray_port": port_base, "grpc_port": port_base + 10, "expose_internal": True,
            "num_cpus": 4, "runs_dir": str(root / "runs"),
            "services": {"rollout": {"num_cpus": 0.5, "args": {"engine": "vllm", "model": f"preset:{preset}",
                                                               "max_model_len": 256}}}}
    path = root / f"{preset}.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, runs = load_cluster_file(path)
    return Cluster(cfg, runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import statistics
    import tempfile

    import grpc
    import torch
    from ray import serve

    from rlserve.cluster.lifecycle import _serve_start, connect, deploy, down, prepare_auth, serve_config, start_head
    from rlserve.models import resolve_model
    from rlserve.rollout import make_engine
    from rlserve.rollout.interfaces import EngineConfig, SamplingSpec
    from rlserve.security.tokens import read_tokens
    from rlserve.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    ids = prompts(PROMPTS)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0)
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=p)) for p in ids], num_samples=SAMPLES,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0))
    rows = []
    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-"))
    # Serve replicas run with one torch thread (Ray sets OMP_NUM_THREADS=1): so does this process,
    # so that direct and served engines compete on equal terms.
    torch.set_num_threads(1)
    for preset in args.presets:
        path = resolve_model(f"preset:{preset}")
        cfg = EngineConfig(model_path=path, max_model_len=256)
        cluster = bench_cluster(root, preset, 6680)
        start_head(cluster)
        try:
            connect(cluster)
            config = serve_config(cluster.cfg, cluster.runs_dir)
            config["applications"] = [a for a in config["applications"] if a["name"] in ("rollout", "gateway")]
            prepare_auth(cluster)
            _serve_start(cluster, config)
            deploy(cluster, config)
            handle = serve.get_app_handle("rollout")
            channel = grpc.insecure_channel(cluster.grpc_endpoint)
            stub = rollout_pb2_grpc.RolloutStub(channel)
            md = (("authorization", f"Bearer {read_tokens(cluster.token_files[1])[0]}"),)
            # The engines are async (vLLM's AsyncLLM belongs to the loop it starts on): one loop drives both.
            loop = asyncio.new_event_loop()

            async def start():
                return {name: make_engine(name, cfg) for name in ("vllm", "transformers")}

            engines = loop.run_until_complete(start())

            def direct(name: str):
                def run():
                    out = loop.run_until_complete(engines[name].generate(ids, SAMPLES, sampling))
                    return sum(len(s.token_ids) for ss in out for s in ss), None
                return run

            def served(call):
                def run():
                    resp = call()
                    return sum(len(s.token_ids) for c in resp.completions for s in c.samples), resp.engine_seconds
                return run

            paths = {
                "vllm": direct("vllm"),
                "transformers": direct("transformers"),
                "service (gateway gRPC)": served(lambda: stub.Generate(request, metadata=md)),
                "service (handle)": served(lambda: handle.Generate.remote(request).result()),
            }
            samples = {name: [] for name in paths}
            for name, fn in paths.items():  # warm-up
                fn()
            for _ in range(args.repeats):  # interleaved, so drifts in machine load hit every path alike
                for name, fn in paths.items():
                    seconds, (tokens, engine_s) = timed(fn, 1, warmup=0)
                    samples[name].append((seconds, tokens, engine_s))
            channel.close()
            loop.run_until_complete(engines["vllm"].close())
            loop.close()
            engines = None
        finally:
            down(cluster)
        med = {name: statistics.median(s for s, _, _ in v) for name, v in samples.items()}
        for name, values in samples.items():
            tokens = values[-1][1]
            engine = [e for _, _, e in values if e is not None]
            rows.append({"preset": preset, "path": name, "seconds": med[name], "tokens": tokens,
                         "tokens_per_s": tokens / med[name], "time_vs_vllm_direct": med[name] / med["vllm"],
                         "engine_share": statistics.median(engine) / med[name] if engine else 1.0})
    print(table(rows, ["preset", "path", "seconds", "tokens", "tokens_per_s", "time_vs_vllm_direct",
                       "engine_share"]))
    print("wrote", record("rollout", rows, {"prompts": PROMPTS, "samples": SAMPLES, "max_new_tokens": NEW_TOKENS,
                                            "repeats": args.repeats}))


if __name__ == "__main__":
    main()
