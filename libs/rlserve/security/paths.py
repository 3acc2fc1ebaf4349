"""Paths a request may name: only inside the directories the cluster file sets.

Requests name files in several places (`policy.model_name`, `data.train_path`,
a reference `model_path`, rollout `safetensors_path`, learner checkpoint and
HF export paths). Each goes through `PathPolicy`, which resolves it (symlinks
included) and refuses `..`, and anything that does not end up inside one of
the allowed roots, with PERMISSION_DENIED naming the field and the
cluster-file key that widens it. Relative paths are taken relative to the
roots, in order.

Inside the runs directory a caller may name only its own runs' folders
(`PathPolicy.for_runs`): another user's run folder, a run folder that does
not exist and the cluster's state folder are refused with the same words
(PERMISSION_DENIED naming the field), so a refusal says nothing about which
runs exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict

from rlserve.rpc import invalid_argument, permission_denied

MAX_PATH_CHARS = 4096
# Which run folders (by name) a request may name inside the runs directory.
RunAccess = Callable[[str], bool]


class PathsArgs(BaseModel):
    """The cluster's directories, as services get them in their args (from the cluster file)."""

    model_config = ConfigDict(extra="forbid")

    runs_dir: str = "runs"
    model_dirs: list[str] = []
    data_dirs: list[str] = []

    def policy(self) -> PathPolicy:
        return PathPolicy.from_args(self.runs_dir, self.model_dirs, self.data_dirs)


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


@dataclass(frozen=True)
class PathPolicy:
    runs_dir: Path
    model_dirs: tuple[Path, ...] = ()
    data_dirs: tuple[Path, ...] = ()
    # None: every run folder (the services' own calls, admins).
    run_access: RunAccess | None = None

    @classmethod
    def from_args(cls, runs_dir: str, model_dirs: list[str], data_dirs: list[str]) -> PathPolicy:
        """From the service args that `rlserve.cluster.serve_config` derives from the cluster file."""
        from rlserve.models import model_cache_dir

        models = [Path(p) for p in model_dirs] + [model_cache_dir()]
        return cls(Path(runs_dir).resolve(), tuple(p.resolve() for p in models),
                   tuple(Path(p).resolve() for p in data_dirs))

    def for_runs(self, run_access: RunAccess | None) -> PathPolicy:
        """This policy for a caller that may name only the run folders `run_access` admits."""
        return replace(self, run_access=run_access)

    def _admits(self, path: Path) -> bool:
        if self.run_access is None or not _inside(path, self.runs_dir):
            return True
        parts = path.relative_to(self.runs_dir).parts
        return bool(parts) and self.run_access(parts[0])

    def model(self, field: str, value: str) -> Path:
        """An HF model folder to read: the model directories (generated presets included) or a run's output."""
        return confine(field, value, (*self.model_dirs, self.runs_dir), "model_dirs", self._admits)

    def model_name(self, field: str, name: str) -> str:
        """`preset:NAME` as it is; a folder confined to the model directories, holding an HF model."""
        if name.startswith("preset:"):
            return name
        path = self.model(field, name)
        if not (path / "config.json").is_file():
            raise invalid_argument(field, f"{name[:200]!r} is not an HF model folder (no config.json)")
        return str(path)

    def data(self, field: str, value: str) -> Path:
        return confine(field, value, self.data_dirs, "data_dirs", self._admits)

    def run_path(self, field: str, value: str) -> Path:
        """A checkpoint or export location: inside the runs directory only."""
        return confine(field, value, (self.runs_dir,), "runs_dir", self._admits)


def confine(field: str, value: str, roots: tuple[Path, ...], key: str,
            admits: Callable[[Path], bool] = lambda path: True) -> Path:
    """`value` resolved inside one of `roots` (and admitted by `admits`), else PERMISSION_DENIED (`key`: the
    cluster-file setting)."""
    if not value:
        raise permission_denied(field, "empty path")
    if len(value) > MAX_PATH_CHARS or "\x00" in value:
        raise permission_denied(field, f"not a usable path (NUL byte or over {MAX_PATH_CHARS} characters)")
    shown = value if len(value) <= 200 else value[:200] + "..."
    if ".." in PurePosixPath(value).parts:
        raise permission_denied(field, f"{shown!r}: paths may not contain '..'")
    given = Path(os.path.expanduser(value)) if value.startswith("~") else Path(value)
    candidates = [given] if given.is_absolute() else [root / given for root in roots]
    inside, not_admitted = [], False
    for candidate in candidates:
        resolved = candidate.resolve()
        if any(_inside(resolved, root) for root in roots):
            if not admits(resolved):
                not_admitted = True
                continue
            if resolved.exists():
                return resolved
            inside.append(resolved)
    if inside:
        return inside[0]
    if not_admitted:  # the same words whether that run exists, is another user's or is no run at all
        raise permission_denied(field, f"{shown!r} is in the runs directory but not in a run of yours: a spec "
                                       f"may name only its own user's runs")
    allowed = ", ".join(str(r) for r in roots) or "none"
    raise permission_denied(field, f"{shown!r} is outside the directories this cluster allows ({allowed}); "
                                   f"an operator can add one to `{key}` in the cluster file")

