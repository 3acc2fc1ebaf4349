"""Reward plug-ins a request may name: the built-ins, and what the operator allow-listed.

A request (a run spec's `reward.functions[].import_path`, or a `Score`
request) that names code by import path would otherwise run it in the
cluster with the caller's arguments (`subprocess:Popen` ran a shell command).
Only entries of the cluster file's `reward.allowed_plugins` pass; the
operator's own path to new code is `deploy/serve swap reward`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rlserve.rpc import permission_denied

ALLOW_KEY = "reward.allowed_plugins"


def normalize(import_path: str) -> str:
    """`module:attr` as written; `file.py[:attr]` with the file's absolute resolved path; attr defaults to `reward`."""
    target, _, attr = import_path.strip().partition(":")
    if target.endswith(".py"):
        target = str(Path(target).expanduser().resolve())
    return f"{target}:{attr or 'reward'}"


class PluginPolicy:
    def __init__(self, allowed: Iterable[str]):
        self.allowed = frozenset(normalize(p) for p in allowed)

    def check(self, field: str, import_path: str) -> None:
        """PERMISSION_DENIED unless `import_path` is allow-listed (built-ins are named without one)."""
        if normalize(import_path) in self.allowed:
            return
        shown = import_path if len(import_path) <= 200 else import_path[:200] + "..."
        raise permission_denied(field, f"reward plug-in {shown!r} is not allowed on this cluster; an operator "
                                       f"can add it to `{ALLOW_KEY}` in the cluster file (built-in functions "
                                       f"need no import_path)")
