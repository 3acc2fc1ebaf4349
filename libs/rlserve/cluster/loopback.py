"""Keep Serve's gRPC listeners on the configured host (loopback by default).

Ray 2.60 hard-codes `[::]` for every replica's internal gRPC server
(`serve/_private/replica.py`) and for Serve's gRPC proxy
(`serve/_private/grpc_util.py: start_grpc_server`), with no option to change
it. `bind_loopback` is installed as Ray's `worker_process_setup_hook` by
every rlserve driver (see `rlserve.cluster.lifecycle.connect`), so it runs
in the Serve processes before they open those sockets and rewrites the
wildcard to RLSERVE_BIND_HOST. rlserve's own config keeps Serve's proxies
off (the public endpoint is the gateway app, which binds the cluster file's
host itself); should one be started anyway (scripts/bench/gateway.py starts
it as the reference), it binds there too. It touches two private functions:
Ray is pinned to 2.60.0, and tests/integration/test_swap_and_loopback.py
fails if anything listens beyond loopback.
"""

from __future__ import annotations

import os

BIND_HOST_ENV = "RLSERVE_BIND_HOST"
_WILDCARDS = ("[::]", "0.0.0.0", "::", "")


def rewrite(address: str, host: str) -> str:
    """`[::]:9000` -> `127.0.0.1:9000` (any wildcard host; other hosts unchanged)."""
    hostpart, sep, port = address.rpartition(":")
    if sep and hostpart in _WILDCARDS:
        return f"{host}:{port}"
    return address


def bind_loopback() -> None:
    host = os.environ.get(BIND_HOST_ENV, "127.0.0.1")
    if host in _WILDCARDS:
        return  # the user asked for all interfaces
    from ray.serve._private import default_impl, replica

    if getattr(default_impl.add_grpc_address, "_rlserve", False):
        return
    original_proxy = default_impl.add_grpc_address
    original_replica = replica.add_port_to_grpc_server

    def add_grpc_address(server, address):
        return original_proxy(server, rewrite(address, host))

    def add_port_to_grpc_server(server, address):
        return original_replica(server, rewrite(address, host))

    add_grpc_address._rlserve = True
    default_impl.add_grpc_address = add_grpc_address
    replica.add_port_to_grpc_server = add_port_to_grpc_server
