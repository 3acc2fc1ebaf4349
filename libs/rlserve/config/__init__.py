"""Run specs and cluster files: schemas, loading, and readable errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlserve.config.errors import SpecError, format_validation_error
from rlserve.config.spec import RunSpec

__all__ = ["MAX_SPEC_BYTES", "RunSpec", "SpecError", "load_spec", "parse_spec", "spec_to_yaml"]

# A spec is a page of YAML; anything far larger, deeper or busier is a mistake or an attack. The
# bounds are checked on the parser's event stream (LibYAML, C) before any value is built, so a
# refused document costs what reading it costs.
MAX_SPEC_BYTES = 256 * 1024
MAX_SPEC_DEPTH = 32
MAX_SPEC_NODES = 20_000
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_events(text: str) -> None:
    """Aliases (`*ref` lets a small document expand into a huge one), depth and node count, from the
    parser's events alone."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            raise SpecError([f"<root>: aliases (*{event.anchor}) are not allowed in a spec"])
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                raise SpecError([f"<root>: nested deeper than {MAX_SPEC_DEPTH} levels"])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        if isinstance(event, (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            nodes += 1
            if nodes > MAX_SPEC_NODES:
                raise SpecError([f"<root>: more than {MAX_SPEC_NODES} values; a run spec is a page of settings"])


class _SpecLoader(_Loader):
    """Mappings with a key given twice are refused (YAML would keep the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise SpecError([f"{key}: given twice in one mapping (line {key_node.start_mark.line + 1})"])
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_spec(data: Any) -> RunSpec:
    """Validate a parsed YAML document; raise SpecError naming every bad key path."""
    if data is None:
        raise SpecError(["<root>: an empty spec; give at least the sections that differ from the defaults"])
    if not isinstance(data, dict):
        raise SpecError([f"<root>: a run spec is a mapping of sections, got {type(data).__name__}"])
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
        _check_events(text)
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        if "nesting depth" in str(err):  # LibYAML's own limit, met before the event check's
            raise SpecError([f"<root>: nested deeper than {MAX_SPEC_DEPTH} levels"]) from None
        raise SpecError([f"<root>: not valid YAML: {str(err)[:500]}"]) from None
    except SpecError:
        raise
    except ValueError as err:  # a value YAML cannot build: an integer of thousands of digits
        raise SpecError([f"<root>: a value cannot be read: {str(err)[:200]}"]) from None
    return parse_spec(data)


def spec_to_yaml(spec: RunSpec) -> str:
    """The fully resolved spec (defaults filled in), for the run directory."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
