"""`down` stops a node's process group: at once when its processes end on SIGTERM (its ended leader, this
process's child, is reaped rather than waited on as alive), after the grace period with SIGKILL when one
ignores it."""

from __future__ import annotations

import subprocess
import sys
import time

from rlserve.cluster.lifecycle import _group_alive, _stop_group


def _group(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.5)  # the interpreter is up and its handlers set
    return proc


def test_a_group_that_ends_on_sigterm_stops_without_the_grace_period():
    proc = _group("import time; time.sleep(60)")
    t0 = time.monotonic()
    _stop_group(proc.pid, grace_s=20)
    assert time.monotonic() - t0 < 5
    assert proc.poll() is not None and not _group_alive(proc.pid)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    proc = _group("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    t0 = time.monotonic()
    _stop_group(proc.pid, grace_s=1)
    assert 1 <= time.monotonic() - t0 < 5
    assert proc.wait(timeout=5) == -9
