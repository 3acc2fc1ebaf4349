"""The run record is not a blackboard: outside `runs/record.py` nothing changes a run's ledger or
assigns its fields; the loop and the manager use its commands (count_generated, drop, record_step,
rewind, finish, resume, set_state, end), each of which announces itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlserve.config import RunSpec
from rlserve.runs.record import Run

ROOT = Path(__file__).resolve().parents[3]
LEDGER_CHANGES = {"generate", "drop", "train", "rewind"}
RUN_FIELDS = {"step", "version", "ledger", "state", "error", "spec", "last_metrics", "final_model_path", "plot_path",
              "resume_reason"}


def test_only_the_record_changes_a_runs_ledger_or_fields():
    offenders = []
    for path in [*(ROOT / "libs" / "rlserve").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        if path.name in ("record.py", "ledger.py") and path.parent.name == "runs" or "/v1/" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in LEDGER_CHANGES and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr == "ledger":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .ledger.{node.func.attr}()")
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and el.attr in RUN_FIELDS \
                                and isinstance(el.value, ast.Name) and el.value.id == "run":
                            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} run.{el.attr} =")
    assert offenders == []


def test_the_fields_are_read_only_views(tmp_path):
    run = Run("r", RunSpec(), tmp_path / "r")
    for field in ("step", "version", "ledger", "state", "spec"):
        with pytest.raises(AttributeError):
            setattr(run, field, None)
    run.count_generated(8)
    run.drop("stale", 2, "dropped 2")
    run.record_step(1, 1, {"batch/trajectories_trained": 6.0, "reward/mean": 0.5})
    assert (run.step, run.version, run.ledger.balanced(), run.last_metrics["reward/mean"]) == (1, 1, True, 0.5)
    run.last_metrics["reward/mean"] = 9.0  # a copy: the record is unchanged
    assert run.last_metrics["reward/mean"] == 0.5
