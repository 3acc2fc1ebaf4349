"""What the OpenAI-compatible endpoint adds to a model call, and the calls/s it sustains.

One local cluster (the embedded default with vLLM's CPU engine on tiny-chat, or `--cluster FILE` on a GPU
box) runs one `external_agent` run, held at its first step (a step of more episodes than are played here)
while the calls are timed. Each call generates `--max-tokens` tokens greedily; per path, one call at a time,
the paths interleaved in rounds so drifts in load hit each alike:

    generate     rollout `Generate` through the gateway's gRPC endpoint (admin token): the floor
    completion   POST /v1/completions with the same prompt as token ids (HTTP + JSON, the coordinator's hop,
                 the capture)
    chat         POST /v1/chat/completions with the prompt as a user message (also the chat template)
    episode      chat calls inside a training episode, each continuing the last (also the continuation
                 check in token space and the join into the episode's sequence)

Then `--concurrency` agents make lone chat calls for `--seconds`, and as many clients call `Generate`
directly: calls/s and the median latency each way. Prints a table; writes bench-results/agents_endpoint.json.

CPU (2 cores; the integration lock, it starts a cluster):
    flock /tmp/rlserve-integration.lock .venv/bin/python scripts/bench/agents_endpoint.py
GPU (the lead's run; any cluster file whose rollout serves a model with a chat template, e.g. tiny-chat):
    .venv/bin/python scripts/bench/agents_endpoint.py --cluster my_gpu_cluster.yaml --max-tokens 32 \
        --concurrency 64 --calls 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import default_cluster_data, record, table  # noqa: E402

PROMPT = "What is 123*45? Answer with the number."
COLUMNS = ["path", "calls", "p50_ms", "p90_ms", "added_p50_ms", "completion_tokens"]
LOAD_COLUMNS = ["path", "concurrency", "calls", "calls_per_s", "p50_ms"]


def cluster_file(root: Path, given: Path | None) -> Path:
    import yaml

    data = yaml.safe_load(given.read_text()) if given else default_cluster_data("vllm")
    if not given:
        data["services"]["rollout"]["args"].update(model="preset:tiny-chat", max_model_len=256)
        data["services"]["reference"]["args"]["model"] = "preset:tiny-chat"
    data.update({"ray_port": 6790, "grpc_port": 9310, "http_port": 9311, "runs_dir": str(root / "runs"),
                 "expose_internal": True})
    # The measurement's one caller must not meet the per-caller limits (50 calls/s by default).
    data.setdefault("tenancy", {})["callers"] = {"calls_per_s": 100_000, "call_burst": 100_000,
                                                 "max_calls_in_flight": 4096}
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_spec(model: str, max_tokens: int) -> str:
    import yaml

    return yaml.safe_dump({
        "name": "bench-agents", "policy": {"model_name": model, "max_total_sequence_length": 256,
                                          "generation": {"max_new_tokens": max_tokens, "temperature": 0.0}},
        "data": {"task": "tool_multiplication", "task_args": {"use_tool": False}, "prompt_format": "chat",
                 "num_train": 512, "num_val": 8},
        "grpo": {"num_prompts_per_step": 64, "num_generations_per_prompt": 4, "max_num_steps": 1,
                 "val_period": 0, "val_at_start": False},
        "env": {"enabled": True, "name": "external_agent", "timeout_s": 3600},
        "checkpointing": {"enabled": False}, "logger": {"plot_enabled": False}})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(args, http_url: str, grpc_endpoint: str, key: str, admin: str, model: str, tok
                  ) -> tuple[list[dict], list[dict]]:
    import grpc
    import httpx
    from openai import APIStatusError, AsyncOpenAI

    from rlserve.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    prompt_ids = tok.episode_prompt_ids([{"role": "user", "content": PROMPT}])
    channel = grpc.aio.insecure_channel(grpc_endpoint)
    rollout = rollout_pb2_grpc.RolloutStub(channel)
    metadata = (("authorization", f"Bearer {admin}"),)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens, stop_token_ids=tok.eos_ids)
    client = AsyncOpenAI(base_url=http_url, api_key=key, max_retries=0, timeout=600)
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600)
    tokens: dict[str, list[int]] = {p: [] for p in ("generate", "completion", "chat", "episode")}

    async def generate() -> None:
        resp = await rollout.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt_ids))], num_samples=1,
            sampling=sampling, run_id=model), metadata=metadata)
        tokens["generate"].append(len(resp.completions[0].samples[0].token_ids))

    async def completion() -> None:
        resp = await client.completions.create(model=model, prompt=prompt_ids, max_tokens=args.max_tokens,
                                               temperature=0.0)
        tokens["completion"].append(resp.usage.completion_tokens)

    async def chat() -> None:
        resp = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=args.max_tokens, temperature=0.0)
        tokens["chat"].append(resp.usage.completion_tokens)

    episode_state: dict = {}

    async def episode_call() -> None:
        """The next call of the current training episode (a new episode every --calls-per-episode calls)."""
        if not episode_state or episode_state["calls"] == args.calls_per_episode:
            if episode_state:
                await http.post(f"{episode_state['base_url']}/reward", json={"reward": 0.0})
            while True:
                ep = (await http.get(f"{http_url}/episodes/next", params={"model": model, "wait_s": 30})).json()
                if ep["episode_id"]:
                    break
            episode_state.update(ep, calls=0, messages=list(ep["messages"]),
                                 client=client.with_options(base_url=ep["base_url"]))
        resp = await episode_state["client"].chat.completions.create(model=model, messages=episode_state["messages"])
        episode_state["messages"] += [resp.choices[0].message.model_dump(exclude_none=True),
                                      {"role": "user", "content": "And then?"}]
        episode_state["calls"] += 1
        tokens["episode"].append(resp.usage.completion_tokens)

    while True:  # the run serves calls once its first play opened its session (503 until then)
        try:
            await chat()
            break
        except APIStatusError as err:
            if err.status_code != 503:
                raise
            await asyncio.sleep(0.5)
    paths = {"generate": generate, "completion": completion, "chat": chat, "episode": episode_call}
    times: dict[str, list[float]] = {p: [] for p in paths}
    for fn in paths.values():  # warm-up: the engine, the template, the connections
        for _ in range(3):
            await fn()
    for k in tokens:
        tokens[k].clear()
    per_round = max(1, args.calls // args.rounds)
    for _ in range(args.rounds):
        for name, fn in paths.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                await fn()
                times[name].append(time.perf_counter() - t0)
    if episode_state:
        await http.post(f"{episode_state['base_url']}/reward", json={"reward": 0.0})
    floor = statistics.median(times["generate"])
    rows = [{"path": name, "calls": len(t), "p50_ms": 1e3 * statistics.median(t), "p90_ms": 1e3 * percentile(t, 0.9),
             "added_p50_ms": 1e3 * (statistics.median(t) - floor),
             "completion_tokens": statistics.median(tokens[name])} for name, t in times.items()]

    async def load(name, fn) -> dict:
        done: list[float] = []
        stop = time.perf_counter() + args.seconds

        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await fn()
                done.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        return {"path": name, "concurrency": args.concurrency, "calls": len(done), "calls_per_s": len(done) / wall,
                "p50_ms": 1e3 * statistics.median(done)}

    loads = [await load("generate", generate), await load("chat", chat)]
    await client.close()
    await http.aclose()
    await channel.close()
    return rows, loads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", type=Path, help="a cluster file (default: the embedded one, vLLM on tiny-chat)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--calls", type=int, default=100, help="timed calls per path")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls-per-episode", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.data.prompts import PromptTokenizer
    from rlserve.models import resolve_model
    from rlserve.security.tokens import read_tokens
    from rlserve.v1 import coordinator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-agents-"))
    cluster = Cluster(*load_cluster_file(cluster_file(root, args.cluster)))
    model_name = cluster.cfg.services.rollout.args["model"]
    tok = PromptTokenizer(resolve_model(model_name), "chat", None)
    up(cluster)
    try:
        key, admin = (read_tokens(f)[0] for f in cluster.token_files)
        with CoordinatorClient(cluster.grpc_endpoint) as coordinator:
            run = coordinator.submit(run_spec(model_name, args.max_tokens))
            for ev in coordinator.watch(run.run_id):  # the run plays once its first episodes are offered
                if ev.kind == pb.EVENT_KIND_STATE and ev.state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED):
                    raise SystemExit(f"the run ended: {ev.message}")
                if ev.kind == pb.EVENT_KIND_INFO and ev.message.startswith("learner ready"):
                    break
            rows, loads = asyncio.run(measure(args, f"{cluster.http_url}/v1", cluster.grpc_endpoint, key, admin,
                                              run.run_id, tok))
            coordinator.cancel(run.run_id)
    finally:
        down(cluster)
    print(table(rows, COLUMNS))
    print(table(loads, LOAD_COLUMNS))
    print("wrote", record("agents_endpoint", rows + loads, {
        "cluster": str(args.cluster or "embedded default, vLLM CPU, tiny-chat"), "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "seconds": args.seconds}))


if __name__ == "__main__":
    main()
