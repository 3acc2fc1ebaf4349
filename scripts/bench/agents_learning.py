"""The example agent learns: examples/agents/calculator_agent.py (the `openai` client only) plays
examples/agents/grpo_calculator_agent.yaml on a local tiny-chat cluster (examples/cluster_chat.yaml, its own
ports) until the run ends; prints the held-out accuracy at each validation (the SFT warm start's, then
GRPO's: greedy episodes the agents play and the run never trains on) and writes
bench-results/agents_learning.json with the curve.

    flock /tmp/rlserve-integration.lock .venv/bin/python scripts/bench/agents_learning.py [--agents 16] [--steps 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.common import record, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=16, help="episodes the agent plays at once")
    parser.add_argument("--steps", type=int, help="grpo.max_num_steps (default: the example's)")
    args = parser.parse_args()

    import yaml

    from rlserve.clients.coordinator import CoordinatorClient
    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster, down, up
    from rlserve.security.tokens import read_tokens
    from rlserve.v1 import coordinator_pb2 as pb

    spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / "examples/agents/calculator_agent.py")
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-agent-learns-"))
    data = yaml.safe_load((ROOT / "examples/cluster_chat.yaml").read_text())
    data.update({"ray_port": 6792, "grpc_port": 9312, "http_port": 9313, "runs_dir": str(root / "runs")})
    data.setdefault("tenancy", {})["callers"] = {"calls_per_s": 1000, "call_burst": 1000}  # many agents, one key
    (root / "cluster.yaml").write_text(yaml.safe_dump(data))
    cluster = Cluster(*load_cluster_file(root / "cluster.yaml"))
    run_spec = yaml.safe_load((ROOT / "examples/agents/grpo_calculator_agent.yaml").read_text())
    if args.steps:
        run_spec["grpo"]["max_num_steps"] = args.steps
    t0 = time.time()
    up(cluster)
    try:
        key = read_tokens(cluster.token_files[0])[0]
        with CoordinatorClient(cluster.grpc_endpoint) as coordinator:
            run = coordinator.submit(yaml.safe_dump(run_spec))
            client = agent.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=key, timeout=600, max_retries=2)

            def play() -> None:
                while agent.play(client, run.run_id):
                    pass

            threads = [threading.Thread(target=play, daemon=True) for _ in range(args.agents)]
            for t in threads:
                t.start()
            curve = []
            for ev in coordinator.watch(run.run_id, timeout_s=24 * 3600):
                if ev.kind == pb.EVENT_KIND_VALIDATION or ev.kind in (pb.EVENT_KIND_ERROR, pb.EVENT_KIND_WARNING):
                    print(f"{time.time() - t0:7.0f}s step {ev.step}: {ev.message[:160]}", flush=True)
                if ev.kind == pb.EVENT_KIND_VALIDATION:
                    sft = "sft/val_reward" in ev.metrics
                    curve.append({"phase": "sft" if sft else "grpo",
                                  "step": int(ev.metrics["sft/step"]) if sft else ev.step,
                                  "val_accuracy": ev.metrics["sft/val_reward" if sft else "val/reward"],
                                  "seconds": time.time() - t0})
            for t in threads:
                t.join(timeout=60)
            final = coordinator.get(run.run_id)
    finally:
        down(cluster)
    print(table(curve, ["phase", "step", "val_accuracy", "seconds"]))
    print(f"run {final.run_id}: {pb.RunState.Name(final.state)} {final.error}; last metrics "
          f"{json.dumps({k: round(v, 3) for k, v in final.last_metrics.items() if k.startswith('val/')})}")
    print("wrote", record("agents_learning", curve, {
        "agents": args.agents, "spec": "examples/agents/grpo_calculator_agent.yaml",
        "state": pb.RunState.Name(final.state), "error": final.error}))


if __name__ == "__main__":
    main()
