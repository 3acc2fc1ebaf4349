"""The offline bundle's pieces without a network: trimming a wheel keeps it a valid wheel (RECORD, exec bits),
requirements dropped from METADATA, and which projects the closure leaves to the target image."""

from __future__ import annotations

import base64
import hashlib
import stat
import zipfile
from pathlib import Path

from rlserve.bundle.build import Requirement, _closure, _drop_requirements, read_image, wheel_requirements
from rlserve.bundle.trim import trim_wheel


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], requires: list[str],
               executable: tuple[str, ...] = ()) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    members = {**files, f"{info}/METADATA": meta.encode(), f"{info}/WHEEL": b"Wheel-Version: 1.0\n"}
    rows = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
            for n, d in members.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(path, "w") as z:
        for n, d in {**members, f"{info}/RECORD": ("\n".join(rows) + "\n").encode()}.items():
            zi = zipfile.ZipInfo(n)
            zi.external_attr = ((0o755 if n in executable else 0o644) | stat.S_IFREG) << 16
            z.writestr(zi, d)
    return path


def record(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("RECORD"))
        return {row.split(",")[0]: row.split(",")[1] for row in z.read(name).decode().splitlines() if row}


def test_trimmed_wheel_lists_exactly_its_files_and_keeps_exec_bits(tmp_path):
    src = make_wheel(tmp_path, "ray", "2.60.0", {"ray/__init__.py": b"x = 1\n", "ray/jars/big.jar": b"j" * 1000,
                                                 "ray/core/raylet": b"#!/bin/sh\necho hi\n"},
                     ["click>=7"], executable=("ray/core/raylet",))
    out = tmp_path / "out"
    out.mkdir()
    report = trim_wheel(src, out / src.name, ("ray/jars/",), ())
    assert report.removed == {"ray/jars/": {"files": 1, "bytes": 1000}}
    with zipfile.ZipFile(out / src.name) as z:
        names = set(z.namelist())
        assert "ray/jars/big.jar" not in names and "ray/core/raylet" in names
        assert (z.getinfo("ray/core/raylet").external_attr >> 16) & 0o111
        rows = record(out / src.name)
        assert set(rows) == names
        for n in names - {n for n in names if n.endswith("RECORD")}:
            digest = base64.urlsafe_b64encode(hashlib.sha256(z.read(n)).digest()).rstrip(b"=").decode()
            assert rows[n] == f"sha256={digest}"


def test_dropped_requirements_leave_metadata_and_record_consistent(tmp_path):
    wheel = make_wheel(tmp_path, "ray", "2.60.0", {"ray/__init__.py": b""},
                       ["click>=7", 'py-spy>=0.4.0; extra == "serve"', 'virtualenv; extra == "serve"'])
    dropped = _drop_requirements(wheel, ("py-spy", "virtualenv"))
    assert len(dropped) == 2
    assert [str(r) for r in wheel_requirements(wheel)] == ["click>=7"]
    with zipfile.ZipFile(wheel) as z:
        meta = z.read("ray-2.60.0.dist-info/METADATA")
    digest = base64.urlsafe_b64encode(hashlib.sha256(meta).digest()).rstrip(b"=").decode()
    assert record(wheel)["ray-2.60.0.dist-info/METADATA"] == f"sha256={digest}"


def test_closure_leaves_out_what_the_image_has_at_an_accepted_version(tmp_path):
    wheels = {
        "ray": make_wheel(tmp_path, "ray", "2.60.0", {}, ["aiohttp>=3.14.4", "click>=7", 'fastapi; extra == "serve"',
                                                           'py-spy; extra == "serve"']),
        "aiohttp": make_wheel(tmp_path, "aiohttp", "3.14.5", {}, ["yarl"]),
        "click": make_wheel(tmp_path, "click", "8.5.1", {}, []),
        "fastapi": make_wheel(tmp_path, "fastapi", "0.165.0", {}, ["starlette"]),
        "starlette": make_wheel(tmp_path, "starlette", "1.10.0", {}, []),
        "py-spy": make_wheel(tmp_path, "py_spy", "0.4.3", {}, []),
        "yarl": make_wheel(tmp_path, "yarl", "1.25.1", {}, []),
    }
    image_file = tmp_path / "image.txt"
    image_file.write_text("# comment\naiohttp==3.14.3\nclick==8.5.0\nyarl\n")
    left_out: dict[str, str] = {}
    chosen = _closure([Requirement("ray[serve]==2.60.0")], wheels, {"python_version": "3.12", "sys_platform": "linux",
                      "platform_machine": "x86_64"}, read_image(image_file), {"py-spy"}, (), left_out)
    # aiohttp 3.14.3 is below ray's >=3.14.4: bundled, with its needs (yarl is the image's).
    assert chosen == {"ray", "aiohttp", "fastapi", "starlette"}
    assert "click-8.5.1-py3-none-any.whl" in left_out and "py_spy-0.4.3-py3-none-any.whl" in left_out
