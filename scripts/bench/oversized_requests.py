"""What an oversized request costs the gateway: refused by gRPC's transport, or read and refused by the limiter.

The gateway's own server (`rlserve.gateway.server.start`, authentication off, nothing forwarded) in this
process, on its event loop; a client in another process sends `--calls` SubmitRuns of `--mb` MB each, one
at a time. Side by side: without internal RPCs (gRPC's receive limit is `tenancy.callers.max_request_kb`, so the
transport refuses from the length prefix) and with them (the limit is 64 MiB: the request is read in full
and the limiter refuses it). Reported: the gateway process's CPU per call, and the client's seconds per call.

    .venv/bin/python scripts/bench/oversized_requests.py [--calls 10] [--mb 60]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402

CLIENT = """
import sys, time, grpc
from rlserve.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc
endpoint, calls, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
request = pb.SubmitRunRequest(spec_yaml="a: " + "x" * (mb * 2**20))
with grpc.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 2**30)]) as channel:
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    t0 = time.perf_counter()
    for _ in range(calls):
        try:
            stub.SubmitRun(request, timeout=60)
            raise SystemExit("an oversized request was accepted")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    print((time.perf_counter() - t0) / calls)
"""


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(expose_internal: bool, calls: int, mb: int) -> dict:
    from rlserve.gateway import server
    from rlserve.gateway.run_table import RunTable
    from rlserve.tenancy.policy import CallerLimits

    async def forward(method, request, caller):
        raise AssertionError("an oversized request was forwarded")

    async def forward_stream(method, request, caller):
        raise AssertionError("an oversized request was forwarded")
        yield

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = server.GatewayConfig(host="127.0.0.1", port=port, tokens=None, expose_internal=expose_internal,
                               limits=CallerLimits(), apps={})
    grpc_server = await server.start(cfg, forward, forward_stream, RunTable())
    try:
        before = cpu_s()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, f"127.0.0.1:{cfg.port}", str(calls), str(mb),
            stdout=asyncio.subprocess.PIPE)
        out, _ = await client.communicate()
        if client.returncode:
            raise SystemExit(f"the client failed ({client.returncode})")
        return {"refused by": "the limiter, read in full" if expose_internal else "gRPC's transport, unread",
                "expose_internal": expose_internal, "calls": calls, "mb": mb,
                "gateway_cpu_ms_per_call": (cpu_s() - before) / calls * 1e3,
                "client_s_per_call": float(out.decode().strip())}
    finally:
        await grpc_server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--mb", type=int, default=60)
    args = parser.parse_args()
    rows = [asyncio.run(measure(exposed, args.calls, args.mb)) for exposed in (False, True)]
    ratio = rows[1]["gateway_cpu_ms_per_call"] / rows[0]["gateway_cpu_ms_per_call"]
    print(table(rows, ["refused by", "calls", "mb", "gateway_cpu_ms_per_call", "client_s_per_call"]))
    print(f"read in full costs the gateway {ratio:.1f}x the CPU of a transport refusal")
    print("wrote", record("oversized_requests", rows, {"read_in_full_vs_transport": ratio}))


if __name__ == "__main__":
    main()
