"""Run specs and cluster files: schemas, loading, and readable errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlserve.config.errors import SpecError, format_validation_error
from rlserve.config.spec import RunSpec

__all__ = ["MAX_SPEC_BYTES", "RunSpec", "SpecError", "load_spec", "parse_spec", "spec_to_yaml"]

# A spec is a page of YAML; anything far larger or deeper is a mistake or an attack.
MAX_SPEC_BYTES = 256 * 1024
MAX_SPEC_DEPTH = 32


def _too_deep(data: Any) -> bool:
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SPEC_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children)
    return False


class _SpecLoader(yaml.SafeLoader):
    """YAML without aliases: `*ref` lets a small document expand into a huge one when validated."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed in a spec",
                                              event.start_mark)
        return super().compose_node(parent, index)


def parse_spec(data: Any) -> RunSpec:
    """Validate a parsed YAML document; raise SpecError naming every bad key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"<root>: a run spec is a mapping of sections, got {type(data).__name__}"])
    if _too_deep(data):
        raise SpecError([f"<root>: nested deeper than {MAX_SPEC_DEPTH} levels"])
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, RunSpec)) from None


def load_spec(text_or_path: str | Path) -> RunSpec:
    """Parse YAML text, or a path to a YAML file (at most MAX_SPEC_BYTES, no aliases)."""
    if isinstance(text_or_path, Path):
        text = text_or_path.read_text()
    else:
        text = text_or_path
    size = len(text.encode(errors="replace"))
    if size > MAX_SPEC_BYTES:
        raise SpecError([f"<root>: the spec is {size} bytes; the limit is {MAX_SPEC_BYTES}"])
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise SpecError([f"<root>: not valid YAML: {str(err)[:500]}"]) from None
    except RecursionError:
        raise SpecError(["<root>: nested too deeply"]) from None
    return parse_spec(data)


def spec_to_yaml(spec: RunSpec) -> str:
    """The fully resolved spec (defaults filled in), for the run directory."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
