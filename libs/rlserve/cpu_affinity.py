"""Where and how eagerly a service's processes run on the CPUs, for clusters that generate and train on them.

On a CPU-only machine the rollout engine and the learner compete for the same cores: a
busy engine slows training and the other way round, and vLLM's engine process spins while
it waits for its worker. Giving each its own cores (`services.<name>.cpu_cores` in the
cluster file, `cpu_cores` in the rollout engine's args) turns that contention into overlap.
Linux sets affinity per thread and new threads inherit their creator's, so a process is
pinned by pinning every thread it has; the processes it starts afterwards inherit it.

The same cores also serve the control plane (gateway, coordinator, reward): with training
filling them, a user's GetRun waited seconds behind it (the first soak). The compute
services therefore run niced (`services.<name>.nice`: rollout, reference and learner 10 by
default, against 0 for the control plane: the cluster starts Ray's workers at 0, not Ray's
15), so a call is served as soon as it arrives and training takes what is left; with
nothing else to run, training runs exactly as fast as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

# The environment variables that carry a service's `cpu_cores` and `nice` into its replicas
# (`DeploymentArgs.apply`) and on to the learner's workers; read by `place_from_env`.
ENV = "RLSERVE_CPU_CORES"
NICE_ENV = "RLSERVE_NICE"


def check_cores(cores: Sequence[int], field: str) -> set[int]:
    """The cores as a set; a ValueError naming `field` if this machine lacks one."""
    count = os.cpu_count() or 1
    missing = sorted(c for c in cores if c >= count)
    if missing:
        raise ValueError(f"{field}: cores {missing} do not exist on this machine (it has cores 0-{count - 1})")
    return set(cores)


def pin_process(cores: Sequence[int], field: str, pid: int | str = "self") -> None:
    """Pin every thread of process `pid` (by default this one), and so what it starts later, to `cores`."""
    mask = check_cores(cores, field)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), mask)


def place_from_env() -> None:
    """Called first by every replica (and learner worker): pins it if its service set `cpu_cores`, and
    lowers its CPU priority by its service's `nice` (what it starts later inherits both)."""
    raw = os.environ.get(ENV, "")
    if raw:
        pin_process([int(c) for c in raw.split(",")], f"{ENV}={raw}")
    nice = int(os.environ.get(NICE_ENV) or 0)
    if nice > 0:
        lower_priority(nice)


def lower_priority(nice: int) -> None:
    """Run every thread of this process (and so what it starts later) at niceness `nice` or lower priority.
    Linux keeps a niceness per thread, as it does affinity; raising one needs no privilege."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, max(os.getpriority(os.PRIO_PROCESS, int(tid)), nice)))


@contextlib.contextmanager
def children_on(cores: Sequence[int], field: str) -> Iterator[None]:
    """Processes this thread starts inside the block run on `cores`; this thread, and the threads it
    started meanwhile, are put back on the cores they had."""
    if not cores:
        yield
        return
    before, threads = os.sched_getaffinity(0), set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(0, check_cores(cores, field))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        for tid in set(os.listdir("/proc/self/task")) - threads:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), before)
