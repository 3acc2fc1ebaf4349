"""The generated references (docs/reference/) are those of the models as they are, and say every key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from rlserve.cluster.config import ClusterFile
from rlserve.config import RunSpec
from rlserve.config.reference import PAGES, _sections, main, render

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_pages_are_not_stale(capsys):
    assert main(["--docs", str(ROOT / "docs"), "--check"]) == 0, capsys.readouterr().err


def test_every_section_and_key_is_rendered():
    """Each section gets its heading; each key a row in its section's table, or in the table of the same
    model shown under another path (`services.reward` -> `services.rollout`)."""
    for model in (RunSpec, ClusterFile):
        page = render(model)
        tables = dict(re.findall(r"\n## ([^\n]+)\n\n(.*?)(?=\n## |\Z)", "\n" + page, flags=re.S))
        shown = {}
        for path, section in _sections(model, ""):
            heading = path or "Top level"
            assert heading in tables
            table = tables[shown.setdefault(section, heading)]
            missing = [name for name in section.model_fields if f"| `{name}` |" not in table]
            assert missing == [], f"{heading}: {missing}"
        assert f"{model.__module__}:{model.__name__}" in {p.model for p in PAGES}


class _Inner(BaseModel):
    """A section's docstring."""

    flag: bool = False


class _Example(BaseModel):
    # The count, with
    # two comment lines.
    count: int = Field(3, ge=1, le=9)
    mode: Literal["a", "b"] = "a"  # inline
    name: str | None = Field(None, max_length=8, description="Said by the field itself.")
    tags: list[str] = []
    inner: _Inner = _Inner()


def test_a_row_says_type_default_bounds_and_comment():
    page = render(_Example)
    assert "| `count` | int | `3` | >= 1, <= 9 | The count, with two comment lines. |" in page
    assert '| `mode` | `"a"` or `"b"` | `"a"` |  | inline |' in page
    assert "| `name` | string or `null` | `null` | at most 8 characters | Said by the field itself. |" in page
    assert "| `inner` | [section](#inner) |" in page
    assert "## inner\n\nA section's docstring." in page
