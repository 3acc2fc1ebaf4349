"""Every loss variant gives the result stored in golden_losses.json (see make_golden_losses.py).

Inputs are float64, so the loss and the gradient must agree to float64 rounding
(a refactor may reorder additions); the metric sums are float32 on purpose.
"""

from __future__ import annotations

import pytest

from tests.unit.algorithms.make_golden_losses import evaluate, load_golden

GOLDEN = load_golden()


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_loss_matches_golden(name):
    case = GOLDEN["cases"][name]
    got = evaluate(case["kind"], case["call"], GOLDEN["batches"][case["batch"]])
    assert got["loss"] == pytest.approx(case["loss"], rel=1e-12, abs=1e-12)
    assert got["grad"] == pytest.approx(case["grad"], rel=1e-12, abs=1e-12)
    assert got["metrics"].keys() == case["metrics"].keys()
    for key, value in case["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
