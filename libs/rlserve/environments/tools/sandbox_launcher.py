"""Sets up the python tool's sandbox, then execs the interpreter on the untrusted code.

Run as `python -I -S sandbox_launcher.py CONFIG_JSON` by `sandbox.run_python`
(a script, standard library only: it runs before any isolation and must not
import the project), in a session of its own. In order: new mount, network and PID
namespaces (a user namespace first when not root); a new root holding only
the interpreter's prefix (its site-packages hidden), the system libraries,
/dev/null and /dev/urandom read-only, and the work directory writable at /work; chroot
into it; resource limits; as root, drop to `nobody`; exec. The code is PID 1
of its PID namespace, so when it ends every process it forked ends too.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
NOBODY = 65534
WORK = "/work"  # the work directory, inside
TIMED_OUT = 124  # the exit status at the wall-clock limit (as timeout(1)'s)
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _bind(root: str, path: str, writable: bool = False, at: str | None = None) -> None:
    """`path` at the same place under `root`, or at `at` (symlinks recreated, their targets bound)."""
    inside = root + (at or path)
    if os.path.islink(path) and at is None:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        os.symlink(os.readlink(path), inside)
        _bind(root, os.path.realpath(path), writable)
        return
    if os.path.isdir(path):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        open(inside, "a").close()
    _mount(path, inside, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    _mount(None, inside, None, flags)


def _enter(cfg: dict) -> None:
    # The new root's directories must be traversable by `nobody`, whatever umask the service runs with
    # (the cluster's processes use 077).
    os.umask(0o022)
    root_user = os.getuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if not root_user:
        uid, gid = os.getuid(), os.getgid()
        _check(_libc.unshare(CLONE_NEWUSER | flags), "unshare")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    else:
        _check(_libc.unshare(flags), "unshare")
    pid = os.fork()  # the child is PID 1 of the new PID namespace
    if pid:
        # At the wall-clock limit, kill PID 1 (the kernel then kills its whole namespace) and reap it here,
        # so nothing is left behind, not even a zombie.
        timed_out = []
        signal.signal(signal.SIGALRM, lambda *_: (timed_out.append(True), os.kill(pid, signal.SIGKILL)))
        signal.setitimer(signal.ITIMER_REAL, cfg["wall_s"])
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(TIMED_OUT if timed_out else 128 - code if code < 0 else code)  # signal N: 128 + N
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in cfg["read_only"]:
        if os.path.lexists(path):
            _bind(root, path)
    for path in cfg["hidden"]:  # an empty, read-only directory over it
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    for dev in ("/dev/null", "/dev/urandom"):
        _bind(root, dev, writable=dev == "/dev/null")
    _bind(root, cfg["work_dir"], writable=True, at=WORK)
    _mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir(WORK)
    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if root_user:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        _enter(cfg)
    except OSError as err:
        print(f"sandbox: {err}", file=sys.stderr)
        os._exit(125)
    env = {"PATH": "/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", f"{WORK}/main.py"], env)


if __name__ == "__main__":
    main()
