"""The limits' old keys, still read: each moves to its key in the `tenancy` section with a note naming both.

Before the `tenancy` section, the limits lived in four places, and two names meant two things each:
`max_concurrent_runs` was a user's unfinished runs (`quotas`) and the LoRA runs that train at once (the top
level), `max_queued_runs` a user's waiting runs (`quotas`) and the coordinator's whole queue (its args). A
file (or a Serve config's app args) that still uses an old key keeps working: `migrate` moves the value to its
new key and names each old key with its new one, which `deploy/serve` prints and the coordinator and the
gateway log (`log_deprecated`). An old key and its new key both given (or two old keys of one limit) are an
error naming both: neither silently wins.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from rlserve.logs import event

_CALLER_KEYS = {"max_streams": "max_streams", "max_in_flight": "max_calls_in_flight", "rate": "calls_per_s",
                "burst": "call_burst", "max_request_kb": "max_request_kb"}
_QUOTA_KEYS = {"max_concurrent_runs": "max_unfinished_runs", "max_queued_runs": "max_waiting_runs",
               "max_samples_per_run": "max_samples_per_run", "max_priority": "max_priority"}


class LegacyKeyError(ValueError):
    """An old key that cannot be moved: given beside its new key, or unknown in an old section. The message
    starts with the key's path."""


@dataclass(frozen=True)
class LegacyKeys:
    """Where old keys were read: (old, new) dotted paths, `*` standing for a user's name (a rule whose old path
    ends in `*` moves a user's entry itself: an empty one still limits an admin), and the old sections, which
    must be empty once their keys moved."""

    moves: tuple[tuple[str, str], ...]
    sections: tuple[str, ...]


def _keys(old: str, names: dict[str, str], new: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{old}.{k}", f"{new}.{v}") for k, v in names.items())


_LIMITS = _keys("limits", _CALLER_KEYS, "tenancy.callers")
_QUOTAS = (*_keys("quotas.default", _QUOTA_KEYS, "tenancy.default_user"),
           *_keys("quotas.users.*", _QUOTA_KEYS, "tenancy.users.*"), ("quotas.users.*", "tenancy.users.*"))
_TRAINING = ("max_concurrent_runs", "tenancy.cluster.max_training_runs")
_COORDINATOR = (*_QUOTAS, _TRAINING, ("max_queued_runs", "tenancy.cluster.queue_capacity"),
                ("spec_reading_share", "tenancy.callers.spec_reading_share"))

# The gateway's and the coordinator's Serve app args (a hand-written Serve config: KubeRay's RayService).
GATEWAY_ARGS = LegacyKeys(_LIMITS, ("limits",))
COORDINATOR_ARGS = LegacyKeys(_COORDINATOR, ("quotas",))
# The cluster file: its own old keys, and the coordinator's args inside it.
CLUSTER_FILE = LegacyKeys(
    (*_LIMITS, *_QUOTAS, _TRAINING, *((f"services.coordinator.args.{old}", new) for old, new in _COORDINATOR)),
    ("limits", "quotas", "services.coordinator.args.quotas"))


def migrate(data: dict[str, Any], keys: LegacyKeys) -> tuple[dict[str, Any], dict[str, str]]:
    """`data` (a copy) with every old key of `keys` moved to its new key, and each old key with its new key.
    LegacyKeyError: an old key beside its new one, two old keys of one limit, an unknown key in an old section."""
    data = copy.deepcopy(data)
    moved: dict[str, str] = {}
    set_by: dict[str, str] = {}  # new path -> the old path that set it
    for old, new in sorted(keys.moves, key=lambda m: m[0].endswith("*")):  # keys before the entries that hold them
        for old_path, new_path in _expand(data, old, new):
            if old.endswith("*"):
                if _get(data, old_path) or any(key.startswith(old_path + ".") for key in set_by.values()):
                    continue  # an entry with keys left is refused with its section; one whose keys moved is moved
                _pop(data, old_path)
                if _get(data, new_path) is None:
                    _put(data, new_path, {})
            else:
                if new_path in set_by:
                    raise LegacyKeyError(f"{old_path}: deprecated, and {set_by[new_path]} (deprecated too) sets "
                                         f"the same limit; keep only {new_path}")
                if _present(data, new_path):
                    raise LegacyKeyError(f"{old_path}: deprecated, and {new_path} sets the same limit; keep only "
                                         f"{new_path}")
                _put(data, new_path, _pop(data, old_path))
                set_by[new_path] = old_path
            moved[old_path] = new_path
    for section in keys.sections:
        _drop_section(data, section, keys, moved)
    return data, moved


def _drop_section(data: dict[str, Any], section: str, keys: LegacyKeys, moved: dict[str, str]) -> None:
    """Remove an old section whose keys all moved; one with a key left names it as unknown."""
    if not _present(data, section):
        return
    left = _leaves(_pop(data, section), section)
    if left:
        path = left[0]
        below = _children(keys, path)
        problem = (f"must be a mapping of {', '.join(below)}" if below else
                   f"unknown key (allowed here: {', '.join(_children(keys, path.rsplit('.', 1)[0])) or 'none'})")
        raise LegacyKeyError(f"{path}: {problem}; {section} is deprecated: its limits are in the `tenancy` section")
    if not any(old.startswith(section + ".") for old in moved):
        moved[section] = "tenancy"


def _children(keys: LegacyKeys, path: str) -> list[str]:
    """The old keys one level below `path` (`NAME`: a user's name)."""
    depth = path.count(".") + 1
    return sorted({"NAME" if old.split(".")[depth] == "*" else old.split(".")[depth] for old, _ in keys.moves
                   if old.count(".") >= depth and _matches(".".join(old.split(".")[:depth]), path)})


def _leaves(value: Any, path: str) -> list[str]:
    """The paths of what is left in an old section (empty mappings count as nothing)."""
    if value is None or value == {}:
        return []
    if not isinstance(value, dict):
        return [path]
    return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}.{k}")]


def _matches(pattern: str, path: str) -> bool:
    a, b = pattern.split("."), path.split(".")
    return len(a) == len(b) and all(p in ("*", q) for p, q in zip(a, b))


def _expand(data: dict[str, Any], old: str, new: str) -> list[tuple[str, str]]:
    """(old path, new path) for each key of `data` that `old` names, `*` filled in with a user's name."""
    head, star, tail = old.partition("*")
    if not star:
        return [(old, new)] if _present(data, old) else []
    entries = _get(data, head.rstrip("."))
    if not isinstance(entries, dict):
        return []
    return [(f"{head}{name}{tail}", new.replace("*", name)) for name in entries
            if _present(data, f"{head}{name}{tail}")]


def _present(data: dict[str, Any], path: str) -> bool:
    *parents, last = path.split(".")
    node = _get(data, ".".join(parents)) if parents else data
    return isinstance(node, dict) and last in node


def _get(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _pop(data: dict[str, Any], path: str) -> Any:
    *parents, last = path.split(".")
    node = _get(data, ".".join(parents)) if parents else data
    return node.pop(last) if isinstance(node, dict) else None


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for i, part in enumerate(parents):
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise LegacyKeyError(f"{'.'.join(parents[:i + 1])}: must be a mapping")
    node[last] = value


def migrate_args(data: Any, keys: LegacyKeys) -> Any:
    """For a `model_validator(mode="before")` of a Serve app's args: the old keys moved, and named in the args'
    `deprecated_keys` (old key -> new key), which the replica logs when it starts."""
    if not isinstance(data, dict):
        return data
    data, moved = migrate(data, keys)
    if moved:
        data["deprecated_keys"] = {**(data.get("deprecated_keys") or {}), **moved}
    return data


def log_deprecated(logger: logging.Logger, source: str, moved: dict[str, str]) -> None:
    """One warning a key in `logger`'s structured log, naming where the old key is and its new key."""
    for old, new in moved.items():
        event(logger, "tenancy.deprecated_key", logging.WARNING, source=source, key=old, use=new)
