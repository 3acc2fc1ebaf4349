"""A reward function's description: one type for the run spec, the reward app's deployed default,
the loader, and (through `to_proto`/`from_proto`) the `RewardFunctionSpec` of a Score request."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlserve.v1 import reward_pb2

MAX_NAME_CHARS = 64
MAX_IMPORT_PATH_CHARS = 4096


class BadFunction(ValueError):
    """A `RewardFunctionSpec` message that does not describe a function; `field` names the bad field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class RewardFunctionCfg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # A name of `rlserve.catalog.REWARD_FUNCTIONS` (the built-ins exact_match, math_verify, format,
    # length_penalty, countdown, the model-backed reward_model and llm_judge, and the cluster's enabled
    # plug-ins), or any label when import_path is given.
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    # "package.module:attr" or "/path/file.py:attr" (attr defaults to `reward`). Only plug-ins the
    # operator allow-listed (the cluster file's reward.allowed_plugins).
    import_path: str | None = Field(None, max_length=MAX_IMPORT_PATH_CHARS)
    # Zero is honoured: the function is computed and reported, but adds nothing.
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    # Keyword arguments of a plug-in class's constructor.
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

    def to_proto(self) -> reward_pb2.RewardFunctionSpec:
        return reward_pb2.RewardFunctionSpec(name=self.name, import_path=self.import_path or "", weight=self.weight,
                                             args_json=json.dumps(self.args))

    @classmethod
    def from_proto(cls, f: reward_pb2.RewardFunctionSpec) -> RewardFunctionCfg:
        """BadFunction naming the field (`args_json`, `weight`, ...) when the message does not describe one."""
        try:
            args = json.loads(f.args_json) if f.args_json else {}
        except json.JSONDecodeError as err:
            raise BadFunction("args_json", f"not JSON: {err.msg}") from None
        if not isinstance(args, dict):
            raise BadFunction("args_json", "must be a JSON object")
        try:
            return cls(name=f.name, import_path=f.import_path or None,
                       weight=f.weight if f.HasField("weight") else 1.0, args=args)
        except ValidationError as err:
            first = err.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else "name"
            raise BadFunction("args_json" if field == "args" else field, first["msg"]) from None
