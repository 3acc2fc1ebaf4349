"""Trim a wheel of what a headless Serve cluster never loads, and keep it a valid wheel.

The result has the same file name, so `pip install --no-index --find-links` resolves it like the
original (`ray[serve]==2.60.0`); its RECORD lists exactly the files left, with their new hashes.
Each member keeps its Unix mode (pip restores the exec bits of `raylet` and `gcs_server` from it;
unpacking with Python's zipfile would drop them).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# What Ray 2.60 ships that a Serve cluster without a dashboard never imports: Java jars, the
# dashboard's web front-end, and the libraries beside Serve (RLlib, Data, Tune, Train, LLM).
RAY_TRIM = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/data/", "ray/tune/", "ray/train/",
            "ray/llm/")
# Native files whose symbols are stripped (`strip --strip-unneeded`): debugging data only.
RAY_STRIP = ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")


@dataclass
class TrimReport:
    wheel: str
    bytes_before: int
    bytes_after: int = 0
    removed: dict[str, dict[str, int]] = field(default_factory=dict)  # prefix -> {files, bytes}
    stripped: dict[str, dict[str, int]] = field(default_factory=dict)  # file -> {before, after}
    notes: list[str] = field(default_factory=list)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _strip(data: bytes, strip_bin: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f"
        path.write_bytes(data)
        subprocess.run([strip_bin, "--strip-unneeded", str(path)], check=True)
        return path.read_bytes()


def trim_wheel(src: Path, dest: Path, remove: tuple[str, ...], strip: tuple[str, ...]) -> TrimReport:
    """Copy wheel `src` to `dest` without the members under the `remove` prefixes and with the `strip`
    members stripped (skipped, with a note, where no `strip` program exists)."""
    report = TrimReport(src.name, src.stat().st_size)
    strip_bin = shutil.which("strip")
    if strip and strip_bin is None:
        report.notes.append("no `strip` program on this machine: native files left as they were")
    removed = {p: {"files": 0, "bytes": 0} for p in remove}
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows: list[str] = []
        for info in zin.infolist():
            name = info.filename
            hit = next((p for p in remove if name.startswith(p)), None)
            if hit is not None:
                removed[hit]["files"] += 1
                removed[hit]["bytes"] += info.file_size
                continue
            if name == record_name:
                continue
            data = zin.read(info)
            if name in strip and strip_bin is not None:
                before = len(data)
                data = _strip(data, strip_bin)
                report.stripped[name] = {"before": before, "after": len(data)}
            out = zipfile.ZipInfo(name, date_time=info.date_time)
            out.external_attr = info.external_attr  # the Unix mode, exec bits included
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, data, compresslevel=9)
            if not info.is_dir():
                rows.append(f"{name},{_record_hash(data)},{len(data)}")
        rows.append(f"{record_name},,")
        record = zipfile.ZipInfo(record_name, date_time=zin.getinfo(record_name).date_time)
        record.external_attr = zin.getinfo(record_name).external_attr
        zout.writestr(record, "\n".join(rows) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(dest)
    report.removed = removed
    report.bytes_after = dest.stat().st_size
    return report
