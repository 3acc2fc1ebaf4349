"""The `python` tool: a policy's code run in a throw-away sandbox.

Threat model: the code is hostile (a policy under RL will find any reward hack
its environment allows). It runs in a fresh process (`sandbox_launcher.py`)
with no network (a network namespace of its own, loopback down), in a root of
its own (chroot after a mount namespace) that holds the interpreter and its
standard library, the system libraries and a fresh writable work directory,
and nothing else: no project files, no runs, no tokens, no other home. When the
cluster runs as root the code runs as `nobody`. Limits: CPU seconds, address
space, file size (which also caps its output: stdout and stderr go to files),
processes and open files; it is PID 1 of its own PID namespace, so a fork bomb
or a daemon dies with it; at the wall-clock limit the launcher kills and reaps it. What is not defended:
the kernel itself (a kernel exploit escapes any namespace), and CPU time
shared with the host within the limits. A host that cannot make the
namespaces (no privileges, user namespaces off) gets an error from the tool,
never an unsandboxed run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
NOBODY = 65534
# The launcher's exit status when it could not build the sandbox, and when the code ran out of time.
SETUP_FAILED, TIMED_OUT = 125, 124
# The launcher enforces the wall-clock limit; this process kills it only if it outlives that by this much.
GRACE_S = 5.0


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16_384  # of stdout and of stderr, each; also the largest file the code may write
    processes: int = 32
    open_files: int = 64


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool
    truncated: bool  # an output reached Limits.output_bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """This host cannot build the sandbox (the tool answers with this, it never runs code unsandboxed)."""


def _read_only_paths() -> list[str]:
    prefix = os.path.realpath(sys.base_prefix)
    return [prefix, "/lib", "/lib64", "/usr/lib", "/usr/lib64"]


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run `code` as a script in a new sandbox; its output, exit status and whether a limit stopped it."""
    base = Path(tempfile.mkdtemp(prefix="rlserve-sandbox-"))
    try:
        work, out = base / "work", base / "out"
        (base / "root").mkdir()
        work.mkdir()
        out.mkdir(mode=0o700)
        (work / "main.py").write_text(code)
        if os.getuid() == 0:
            os.chown(work, NOBODY, NOBODY)
            os.chown(work / "main.py", NOBODY, NOBODY)
        stdlib = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
        cfg = {
            "root": str(base / "root"), "work_dir": str(work), "wall_s": limits.wall_s,
            "python": os.path.realpath(sys.executable), "read_only": _read_only_paths(),
            "hidden": [os.path.realpath(stdlib["purelib"]), os.path.realpath(stdlib["platlib"])],
            "limits": {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_AS": limits.memory_mb * 2**20,
                       "RLIMIT_FSIZE": limits.output_bytes, "RLIMIT_NPROC": limits.processes,
                       "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0},
        }
        with open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr:
            proc = subprocess.Popen([os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER), json.dumps(cfg)],
                                    stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, close_fds=True,
                                    start_new_session=True, env={"PATH": "/usr/bin:/bin"})
            try:
                code_ = proc.wait(timeout=limits.wall_s + GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code_ = TIMED_OUT
                proc.wait()
        texts = [(out / name).read_bytes()[:limits.output_bytes] for name in ("stdout", "stderr")]
        if code_ == SETUP_FAILED and texts[1].startswith(b"sandbox: "):
            raise SandboxUnavailable(texts[1].decode(errors="replace").strip())
        timed_out = code_ == TIMED_OUT
        if timed_out:
            code_ = -signal.SIGKILL
        elif code_ > 128:  # the launcher reports the code's death by signal N as 128 + N
            code_ = 128 - code_
        truncated = any(len(t) >= limits.output_bytes for t in texts)
        return Result(texts[0].decode(errors="replace"), texts[1].decode(errors="replace"), code_, timed_out,
                      truncated)
    finally:
        shutil.rmtree(base, ignore_errors=True)
