"""Turn pydantic's validation errors into messages that name the full key path.

A user who writes `grpo.num_prompts_per_stpe: 8` should read
`grpo.num_prompts_per_stpe: unknown key; did you mean 'num_prompts_per_step'?`
and the list of keys allowed there, not a pydantic traceback.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, get_origin

from pydantic import BaseModel, ValidationError


class SpecError(ValueError):
    """A spec failed validation; `problems` holds one 'key.path: message' line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid spec:\n" + "\n".join(f"  - {p}" for p in problems))

    @property
    def first_path(self) -> str:
        return self.problems[0].split(":", 1)[0] if self.problems else ""


_KEY_PREFIX = re.compile(r"^([A-Za-z_][\w.]*): (.*)$", re.S)


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that owns the last element of `loc`, or None."""
    model: Any = root
    mapping_key = False  # the part after a dict-valued field is a key of it (`tenancy.users.alice`)
    for part in loc[:-1]:
        if isinstance(part, int) or mapping_key:
            mapping_key = False
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        mapping_key = get_origin(ann) is dict
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(root, loc)
            allowed = sorted(owner.model_fields) if owner else []
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{path}: unknown key{hint} (allowed here: {', '.join(allowed)})")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] != "value_error" and "input" in e and not isinstance(e["input"], (dict, list)):
            got = repr(e["input"])
            msg += f" (got {got if len(got) <= 80 else got[:80] + '...'})"
        # Validators name the key they judge: "a.b.c: ..." is a path from the
        # root, "key: ..." a key below the validator's own location.
        named = _KEY_PREFIX.match(msg)
        if named:
            key, msg = named.groups()
            path = key if "." in key else f"{path}.{key}" if loc else key
        problems.append(f"{path}: {msg}")
    return problems
