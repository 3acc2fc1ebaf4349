"""`math_verify`: final math answers checked by Hugging Face's `math-verify` package.

The package extracts the completion's final answer (`\\boxed{}`, "the answer is",
or the last expression) and compares it with the reference symbolically: LaTeX,
fractions and decimals, sets and intervals, units and percent signs, equivalent
expressions, GSM8K's `#### 72` solutions. Its own time limits use `signal.alarm`,
which only works in a process's main thread, and the reward service scores in a
worker thread; so the checks run in one helper process (`math_worker`), started
on first use and replaced when a check outlives `timeout_s` (a completion that
sends sympy into a very long computation then scores 0, not the whole batch).
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import threading
from typing import Any

from rlserve.rewards.interfaces import RewardFunction, RewardInput, RewardOutput


class _Worker:
    """One `python -m rlserve.rewards.math_worker` process, one request at a time (JSON lines)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.starting = False  # its first answer also waits for it to import sympy
        self.lock = threading.Lock()
        atexit.register(self._stop)

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def check(self, gold: str, completion: str, timeout_s: float) -> dict[str, Any] | None:
        """The worker's verdict, or None when it took longer than `timeout_s` (the worker is replaced)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen([sys.executable, "-m", "rlserve.rewards.math_worker"], text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)
                self.starting = True
            self.proc.stdin.write(json.dumps({"gold": gold, "completion": completion}) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s + 60.0 * self.starting)
            self.starting = False
            if not ready:
                self._stop()
                return None
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                self.proc = None
                raise RuntimeError(f"the math-verify worker exited with code {code}")
            verdict = json.loads(line)
        if "error" in verdict:
            raise RuntimeError(f"math-verify failed: {verdict['error']}")
        return verdict


_WORKER = _Worker()


class MathVerify(RewardFunction):
    """1 when the completion's final answer equals the reference answer mathematically."""

    name = "math_verify"

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s

    def __call__(self, item: RewardInput) -> RewardOutput:
        verdict = _WORKER.check(item.answer, item.completion, self.timeout_s)
        if verdict is None:
            return RewardOutput(0.0, {"extracted": None, "timeout": True})
        return RewardOutput(float(verdict["correct"]), {"extracted": verdict["extracted"]})
