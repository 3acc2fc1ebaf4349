"""The python tool's sandbox under escape attempts: the network, files outside its work directory,
root, a fork bomb, huge output, an infinite loop and memory; each is contained, and the host (this
test process) sees nothing of it afterwards."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from rlserve.environments.tools.sandbox import Limits, SandboxUnavailable, run_python

try:
    run_python("pass")
except SandboxUnavailable as err:  # the tool refuses to run code here; there is nothing to escape from
    pytest.skip(f"this host cannot build the sandbox: {err}", allow_module_level=True)


def test_code_runs_as_nobody_in_a_root_of_its_own_with_only_the_standard_library(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret")
    r = run_python(f"""
import os, sys
print(os.getuid() if {os.getuid() == 0} else "not-root")
print(sorted(os.listdir("/")))
for path in ["/etc/passwd", {str(secret)!r}, {str(Path.cwd())!r} + "/README.md", "/proc/1/environ"]:
    try:
        open(path).read()
        print("READ", path)
    except OSError as err:
        print("refused", type(err).__name__)
try:
    import torch
    print("IMPORTED torch")
except ImportError:
    print("no torch")
open("/work/mine.txt", "w").write("ok")
try:
    open("/usr/lib/x", "w")
    print("WROTE /usr/lib/x")
except OSError:
    print("read-only")
print(open("/work/mine.txt").read())
""")
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] in ("65534", "not-root")
    assert lines[1] == str(["dev", "lib", "lib64", "root", "usr", "work"])
    assert lines[2:6] == ["refused FileNotFoundError"] * 4
    assert lines[6:] == ["no torch", "read-only", "ok"]


def test_no_network_even_to_this_hosts_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run_python(f"""
import socket
for target in [("127.0.0.1", {port}), ("10.0.0.1", 80)]:
    try:
        socket.create_connection(target, timeout=1)
        print("CONNECTED", target)
    except OSError as err:
        print("refused", type(err).__name__)
""")
        assert r.ok, r.stderr
        assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def nobodys_processes() -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}").stat().st_uid == 65534:
                count += 1
        except FileNotFoundError:
            pass
    return count


def test_a_fork_bomb_is_held_to_its_process_limit_and_dies_with_the_sandbox():
    before = nobodys_processes()
    t0 = time.monotonic()
    r = run_python("""
import os, time
n = 0
while True:
    try:
        if os.fork() == 0:
            os.setsid()  # leave the process group: only the PID namespace still holds it
            time.sleep(600)
        n += 1
    except OSError:
        print("limit at", n, flush=True)
        time.sleep(600)
""", Limits(wall_s=3, processes=16))
    assert r.timed_out and time.monotonic() - t0 < 10
    assert r.stdout.startswith("limit at")
    assert int(r.stdout.split()[2]) < 16
    assert nobodys_processes() <= before  # reaped, not even a zombie left


def test_huge_output_is_cut_at_the_limit():
    r = run_python("while True:\n    print('x' * 1000)", Limits(output_bytes=8192))
    # Python ignores SIGXFSZ, so the write past the limit fails (EFBIG) and the script ends with an error.
    assert r.truncated and len(r.stdout) == 8192 and not r.ok and "File too large" in r.stderr


def test_an_infinite_loop_stops_at_its_cpu_limit_and_a_sleeper_at_the_wall_clock():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", Limits(cpu_s=1, wall_s=20))
    assert r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not r.timed_out and time.monotonic() - t0 < 10
    r = run_python("import time\ntime.sleep(60)", Limits(wall_s=1))
    assert r.timed_out and not r.ok


def test_memory_beyond_the_limit_is_refused():
    r = run_python("b = bytearray(2**31)", Limits(memory_mb=256))
    assert r.exit_code == 1 and "MemoryError" in r.stderr


def test_a_service_with_umask_077_still_builds_a_root_nobody_can_use():
    """The cluster's processes run with umask 077; the sandbox's directories must still be traversable."""
    old = os.umask(0o077)
    try:
        r = run_python("print('ran')")
    finally:
        os.umask(old)
    assert r.ok and r.stdout == "ran\n", r.stderr
