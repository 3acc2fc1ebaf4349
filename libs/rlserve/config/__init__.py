"""Run specs and cluster files: schemas, loading, and readable errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlserve.config.errors import SpecError, format_validation_error
from rlserve.config.spec import RunSpec

__all__ = ["RunSpec", "SpecError", "load_spec", "parse_spec", "spec_to_yaml"]


def parse_spec(data: Any) -> RunSpec:
    """Validate a parsed YAML document; raise SpecError naming every bad key path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"<root>: a run spec is a mapping of sections, got {type(data).__name__}"])
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, RunSpec)) from None


def load_spec(text_or_path: str | Path) -> RunSpec:
    """Parse YAML text, or a path to a YAML file."""
    if isinstance(text_or_path, Path):
        text = text_or_path.read_text()
    else:
        text = text_or_path
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError([f"<root>: not valid YAML: {err}"]) from None
    return parse_spec(data)


def spec_to_yaml(spec: RunSpec) -> str:
    """The fully resolved spec (defaults filled in), for the run directory."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
