"""Things chosen by name: losses, advantage estimators, learner backends.

A registry maps each name to where its code lives ("module:attribute") and
imports that code only when the name is used. The names alone are cheap to
import, so the run spec validates them without loading torch (vLLM's model
registry keeps its lazy "module, class" table for the same reason). An unknown
name fails loudly with the list of valid ones. Adding an entry is its module,
one line in the table that names it, and its test.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Entry = TypeVar("Entry")


@dataclass(frozen=True)
class Registry(Generic[Entry]):
    # What the names name, for messages: "loss", "learner backend", ...
    kind: str
    entries: Mapping[str, Entry]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __getitem__(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.entries)}") from None


def import_object(path: str) -> Any:
    """The object a "package.module:attribute" path names."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
