"""What the public endpoint costs: latency of `GetRun` on one run, by path, side by side.

One local cluster runs the coordinator (with one run on disk) and three gateways (auth off,
bearer token, token + TLS), plus Serve's own gRPC proxy on a loopback port (the pre-gateway
endpoint, for reference; the product keeps it off). Calls go one at a time from this process,
in interleaved rounds so drifts in machine load hit every path alike; the in-cluster handle
call is the floor.

    flock /work/wt/heavy.lock .venv/bin/python scripts/bench/gateway.py --calls 2000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402

PORT_BASE = 6880
RUN_ID = "bench-run"


def bench_cluster(root: Path):
    import yaml

    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster

    data = {"name": "bench-gateway", "ray_port": PORT_BASE, "grpc_port": PORT_BASE + 10, "num_cpus": 4,
            "runs_dir": str(root / "runs")}
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, runs = load_cluster_file(path)
    return Cluster(cfg, runs)


def write_run(runs_dir: Path) -> None:
    """One finished run on disk, as a coordinator leaves it (the coordinator loads it at start)."""
    from rlserve.config import parse_spec, spec_to_yaml

    folder = runs_dir / RUN_ID
    folder.mkdir(parents=True)
    (folder / "spec.yaml").write_text(spec_to_yaml(parse_spec({"name": "bench"})))
    (folder / "run.json").write_text(json.dumps({
        "run_id": RUN_ID, "name": "bench", "state": "succeeded", "step": 100, "weight_version": 100, "error": "",
        "ledger": {"generated": 25600, "scored": 25600, "trained": 20000, "dropped": {"zero_advantage": 5600},
                   "in_flight": 0},
        "created": time.time(), "updated": time.time(), "final_model_path": "", "plot_path": "",
        "last_metrics": {f"metric/{i}": float(i) for i in range(40)}}))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per path")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    import grpc
    from ray import serve

    from rlserve.cluster.lifecycle import connect, deploy, down, prepare_auth, serve_config, start_head
    from rlserve.security.certs import self_signed
    from rlserve.security.tokens import read_tokens
    from rlserve.v1 import coordinator_pb2 as pb
    from rlserve.v1 import coordinator_pb2_grpc

    root = Path(tempfile.mkdtemp(prefix="rlserve-bench-gateway-"))
    cluster = bench_cluster(root)
    write_run(cluster.runs_dir)
    cert, key = self_signed(root / "tls")
    prepare_auth(cluster)
    token = read_tokens(cluster.token_files[0])[0]
    ports = {"auth off": PORT_BASE + 11, "token": PORT_BASE + 10, "token + TLS": PORT_BASE + 12}
    proxy_port = PORT_BASE + 13
    start_head(cluster)
    try:
        connect(cluster)
        # Serve's own gRPC proxy, for reference only (the product runs with proxies off).
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": PORT_BASE + 14},
                    grpc_options={"port": proxy_port, "grpc_servicer_functions": [
                        "rlserve.v1.coordinator_pb2_grpc.add_CoordinatorServicer_to_server"]})
        config = serve_config(cluster.cfg, cluster.runs_dir)
        apps = {a["name"]: a for a in config["applications"]}
        coordinator, gateway = apps["coordinator"], apps["gateway"]
        coordinator["route_prefix"] = "/coordinator"
        tls = {"cert_file": str(cert), "key_file": str(key)}
        variants = [dict(gateway, name="gateway-auth-off", args={**gateway["args"], "auth": None,
                                                                  "port": ports["auth off"]}),
                    gateway,
                    dict(gateway, name="gateway-tls", args={**gateway["args"], "port": ports["token + TLS"],
                                                            "tls": tls})]
        config["applications"] = [coordinator, *variants]
        deploy(cluster, config)
        handle = serve.get_app_handle("coordinator")
        request = pb.GetRunRequest(run_id=RUN_ID)
        bearer = (("authorization", f"Bearer {token}"),)
        channels = {
            "Serve gRPC proxy, no auth (before)": (grpc.insecure_channel(f"127.0.0.1:{proxy_port}"),
                                                   (("application", "coordinator"),)),
            "gateway, auth off": (grpc.insecure_channel(f"127.0.0.1:{ports['auth off']}"), ()),
            "gateway, token": (grpc.insecure_channel(f"127.0.0.1:{ports['token']}"), bearer),
            "gateway, token + TLS": (grpc.secure_channel(f"127.0.0.1:{ports['token + TLS']}",
                                                         grpc.ssl_channel_credentials(cert.read_bytes())), bearer),
        }
        paths = {"handle (in-cluster)": lambda: handle.GetRun.remote(request).result()}
        for name, (channel, md) in channels.items():
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            paths[name] = (lambda s, m: lambda: s.GetRun(request, metadata=m, timeout=30))(stub, md)
        for fn in paths.values():  # warm-up (connections, handles, TLS session)
            for _ in range(50):
                assert fn().run.run_id == RUN_ID
        samples: dict[str, list[float]] = {name: [] for name in paths}
        per_round = max(1, args.calls // args.rounds)
        for _ in range(args.rounds):
            for name, fn in paths.items():
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
        for channel, _ in channels.values():
            channel.close()
    finally:
        down(cluster)
    base = samples["gateway, auth off"]
    rows = []
    for name, values in samples.items():
        p50, p99 = percentile(values, 0.5) * 1e3, percentile(values, 0.99) * 1e3
        rows.append({"path": name, "calls": len(values), "p50_ms": p50, "p99_ms": p99,
                     "mean_ms": statistics.fmean(values) * 1e3,
                     "p50_vs_auth_off": p50 / (percentile(base, 0.5) * 1e3),
                     "p99_vs_auth_off": p99 / (percentile(base, 0.99) * 1e3)})
    print(table(rows, ["path", "calls", "p50_ms", "p99_ms", "mean_ms", "p50_vs_auth_off", "p99_vs_auth_off"]))
    print("wrote", record("gateway", rows, {"rpc": "GetRun", "calls_per_path": per_round * args.rounds,
                                            "rounds": args.rounds}))


if __name__ == "__main__":
    main()
