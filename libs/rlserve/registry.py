"""Things chosen by name: losses, advantage estimators, environments, reward functions, tasks, rollout
engines, learner backends (`rlserve.catalog` holds every registry).

A registry maps each name to where its code lives ("module:attribute") and
imports that code only when the name is used. The names alone are cheap to
import, so the run spec validates them without loading torch (vLLM's model
registry keeps its lazy "module, class" table for the same reason). An unknown
name fails loudly with the list of valid ones.

A registry with an entry-point group is open: a user's package adds entries
without editing rlserve, as Python entry points of the group
(`[project.entry-points."rlserve.losses"] my_loss = "my_pkg.loss:MyLoss"`),
and an operator can name "module:attribute" entries in the cluster file. The
operator decides what a cluster loads: only the packages and entries of the
cluster file's `plugins` section count, which reaches every process of the
cluster as the environment variable `PLUGINS_ENV` (`rlserve.catalog.PluginsCfg`
writes it). Of an enabled package only its metadata is read until one of its
names is used.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Generic, TypeVar

Entry = TypeVar("Entry")

# JSON {"packages": [distribution, ...], "entries": {group: {name: "module:attribute"}}}: the cluster
# file's `plugins` section as every process of the cluster sees it (unset: no plug-ins).
PLUGINS_ENV = "RLSERVE_PLUGINS"
# Entry-point groups of rlserve's open registries start with this.
GROUP_PREFIX = "rlserve."


class PluginError(ValueError):
    """The cluster's plug-ins cannot be read: a package that is not installed, or two entries of one name."""


@dataclass(frozen=True)
class Registry(Generic[Entry]):
    # What the names name, for messages: "loss", "learner backend", ...
    kind: str
    builtins: Mapping[str, Entry]
    # The entry-point group of an open registry ("rlserve.losses"), whose entries are "module:attribute"
    # strings; None: closed, the built-ins only.
    group: str | None = None

    def __post_init__(self) -> None:
        if self.group is not None and not all(isinstance(e, str) for e in self.builtins.values()):
            raise TypeError(f"the {self.kind} registry is open: its entries must be 'module:attribute' strings")

    def plugins(self) -> dict[str, str]:
        """This registry's entries from the cluster's enabled plug-ins: name -> "module:attribute"."""
        if self.group is None:
            return {}
        found = enabled_entries().get(self.group, {})
        for name, (_, source) in found.items():
            if name in self.builtins:
                raise PluginError(f"{source} adds the {self.kind} {name!r}, which is a built-in's name")
        return {name: path for name, (path, _) in found.items()}

    @property
    def names(self) -> tuple[str, ...]:
        """The built-ins', then the enabled plug-ins' names."""
        return (*self.builtins, *sorted(self.plugins()))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.builtins or name in self.plugins()

    def __getitem__(self, name: str) -> Entry:
        if name in self.builtins:
            return self.builtins[name]
        plugins = self.plugins()
        if name in plugins:
            return plugins[name]
        raise self.unknown(name)

    def unknown(self, name: str, valid: Iterable[str] | None = None) -> ValueError:
        """The error for a name that is not one of `valid` (default: all of this registry's)."""
        return ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names if valid is None else valid)}")

    def check(self, name: str, valid: Iterable[str] | None = None) -> str:
        """`name` when it is one of `valid` (default: this registry's names), else ValueError listing them:
        a spec field's validator."""
        valid = self.names if valid is None else tuple(valid)
        if name not in valid:
            raise self.unknown(name, valid)
        return name

    def load(self, name: str) -> Any:
        """The object a "module:attribute" entry names, imported now (ValueError if the name is unknown)."""
        return import_object(self[name])


def enabled_entries() -> dict[str, dict[str, tuple[str, str]]]:
    """group -> name -> ("module:attribute", where it comes from) of this process's enabled plug-ins
    (`PLUGINS_ENV`), read once per setting and import path. Do not modify the answer."""
    return _entries(os.environ.get(PLUGINS_ENV, ""), tuple(sys.path))


@lru_cache(maxsize=4)
def _entries(setting: str, path: tuple[str, ...]) -> dict[str, dict[str, tuple[str, str]]]:
    plugins = json.loads(setting) if setting else {}
    found: dict[str, dict[str, tuple[str, str]]] = {}

    def add(group: str, name: str, target: str, source: str) -> None:
        names = found.setdefault(group, {})
        if name in names:
            raise PluginError(f"{source} and {names[name][1]} both add {name!r} to {group}")
        names[name] = (target, source)

    for package in plugins.get("packages", []):
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            raise PluginError(f"the cluster file's plugins.packages names {package!r}, which is not installed "
                              f"where this process runs ({sys.executable})") from None
        for ep in dist.entry_points:
            if ep.group.startswith(GROUP_PREFIX):
                add(ep.group, ep.name, f"{ep.module}:{ep.attr}", f"package {package!r}")
    for group, names in plugins.get("entries", {}).items():
        for name, target in names.items():
            add(group, name, target, "the cluster file's plugins.entries")
    return found


def import_object(path: str, default_attribute: str | None = None) -> Any:
    """The object "package.module:attribute" or "/path/file.py:attribute" names (`default_attribute` when
    the path names none); ValueError saying what is missing."""
    target, _, attribute = path.partition(":")
    attribute = attribute or default_attribute
    if not attribute:
        raise ValueError(f"{path}: name the object as 'module:attribute'")
    if target.endswith(".py"):
        module = _file_module(path, Path(target).expanduser().resolve())
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ValueError(f"{path}: cannot import {target!r}: {err}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{path}: module {target!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


def _file_module(path: str, file: Path) -> Any:
    """The module of a source file, loaded once per content (a changed file loads as a new module)."""
    if not file.is_file():
        raise ValueError(f"{path}: no such file {file}")
    name = "rlserve_plugin_" + hashlib.sha1(str(file).encode() + file.read_bytes()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return module
