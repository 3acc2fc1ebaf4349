"""An environment's description: the run spec's `env.{name, import_path, args}` and the
`EnvironmentSpec` of a Reset or Step request (`to_proto` / `from_proto`)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlserve.v1 import environment_pb2

# Built-ins that score with reward functions (`args.functions`, else the run's or the service's), and
# the other args each takes.
SCORED = {"single_turn": frozenset(), "tool_use": frozenset({"tools", "max_output_chars", "python_wall_s", "tool_format",
                                                          "declare_tools"})}
MAX_NAME_CHARS = 64
MAX_IMPORT_PATH_CHARS = 4096


class BadEnvironment(ValueError):
    """An `EnvironmentSpec` that describes no environment; `field` names the bad field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class EnvironmentCfg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # A name of `rlserve.catalog.ENVIRONMENTS` (the built-ins single_turn, guess_number, tool_use, and
    # the cluster's enabled plug-ins), or any label when import_path is given.
    name: str = Field("single_turn", min_length=1, max_length=MAX_NAME_CHARS)
    # "package.module:Class" or "/path/file.py:Class"; only plug-ins the operator allow-listed
    # (the cluster file's reward.allowed_plugins, shared by reward functions and environments).
    import_path: str | None = Field(None, max_length=MAX_IMPORT_PATH_CHARS)
    # Keyword arguments of the environment's constructor (JSON data).
    args: dict[str, Any] = {}

    @field_validator("import_path")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None

    @field_validator("args")
    @classmethod
    def _json_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError("must be JSON data (strings, finite numbers, booleans, lists, mappings)") from None
        return v

    def key(self) -> str:
        """A canonical string of the whole description (cache key, version hash)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    def to_proto(self) -> environment_pb2.EnvironmentSpec:
        return environment_pb2.EnvironmentSpec(name=self.name, import_path=self.import_path or "",
                                               args_json=json.dumps(self.args))

    @classmethod
    def from_proto(cls, e: environment_pb2.EnvironmentSpec) -> EnvironmentCfg:
        """BadEnvironment naming the field when the message describes no environment."""
        try:
            args = json.loads(e.args_json) if e.args_json else {}
        except json.JSONDecodeError as err:
            raise BadEnvironment("args_json", f"not JSON: {err.msg}") from None
        if not isinstance(args, dict):
            raise BadEnvironment("args_json", "must be a JSON object")
        try:
            return cls(name=e.name or "single_turn", import_path=e.import_path or None, args=args)
        except ValidationError as err:
            first = err.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else "name"
            raise BadEnvironment("args_json" if field == "args" else field, first["msg"]) from None
