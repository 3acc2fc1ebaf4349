"""The base of every spec section (unknown keys are errors, values checked on assignment, floats
finite) and the upper bounds of the spec's sizes."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator

# Upper bounds of the spec's sizes (a request cannot ask for more).
MAX_STEPS = 1_000_000
MAX_PROMPTS_PER_STEP = 4096
MAX_GENERATIONS_PER_PROMPT = 1024
MAX_TRAJECTORIES_PER_STEP = 65_536
MAX_SEQUENCE_LENGTH = 131_072
MAX_EXAMPLES = 1_000_000
MAX_VAL_EXAMPLES = 100_000
MAX_SEED = 2**31 - 1
MAX_WORKERS = 1024
MAX_ROLLOUT_TURNS = 1024
MAX_LORA_RANK = 1024
MAX_NAME_CHARS = 64
MAX_PATH_CHARS = 4096
MAX_SYSTEM_PROMPT_CHARS = 65_536
# A run's weight in the fair share of a cluster shared with other runs (`rlserve.tenancy.fair_share`).
MAX_PRIORITY = 100.0
# Run names become folder names: letters, digits, '-', '_', '.', not starting with '.'.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def _takes_bool(annotation: Any) -> bool:
    return annotation is bool or any(_takes_bool(a) for a in get_args(annotation))


def _takes_number(annotation: Any) -> bool:
    return annotation in (int, float) or any(_takes_number(a) for a in get_args(annotation))


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, values are checked on assignment, floats finite,
    and a number field never takes true/false (pydantic would read `max_num_steps: true` as 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if isinstance(value, bool) and field is not None and _takes_number(field.annotation) \
                        and not _takes_bool(field.annotation):
                    raise ValueError(f"{key}: a number, not {str(value).lower()}")
        return data
