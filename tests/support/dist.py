"""Run a function on N gloo ranks in spawned processes (file rendezvous: no TCP listener)."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for servers and gloo groups the tests start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlserve.training.distributed import init_process_group

    try:
        init_process_group(rank, world, f"file://{init_file}", torch.device("cpu"))
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on every rank; returns the per-rank results (must be picklable)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        init_file = tempfile.mktemp(prefix="rlserve-test-rdzv-")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        out = dict(results)
    errors = [out[r][1] for r in range(world) if r in out and out[r][0] == "error"]
    if errors or len(out) != world:
        raise AssertionError("rank failed:\n" + "\n".join(errors or [f"results from {sorted(out)} only"]))
    return [out[r][1] for r in range(world)]


def _in_turn(rank: int, world: int, calls: dict[str, tuple]) -> dict[str, Any]:
    return {name: fn(rank, world, *args) for name, (fn, *args) in calls.items()}


def run_ranks_in_turn(world: int, calls: dict[str, tuple]) -> dict[str, list[Any]]:
    """Several runs on one set of `world` gloo ranks, one after the other in the same processes:
    {name: (fn, *args)} -> {name: per-rank results}. A spawn costs about ten seconds of imports on CPU;
    runs that need no fresh process of their own (a restore does) share one."""
    per_rank = run_ranks(world, _in_turn, calls)
    return {name: [per_rank[r][name] for r in range(world)] for name in calls}
