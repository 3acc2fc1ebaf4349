"""The ledger balances: generated == trained + dropped + in flight, and it refuses to overdraw."""

from __future__ import annotations

import pytest

from rlserve.runs.ledger import Ledger


def test_ledger_balances_and_refuses_overdraw():
    ledger = Ledger()
    ledger.generated += 10
    ledger.train(6)
    ledger.drop("stale", 3)
    assert ledger.in_flight == 1 and not ledger.balanced()
    with pytest.raises(ValueError):
        ledger.drop("stale", 2)
    ledger.drop("zero_advantage", 1)
    assert ledger.balanced()
    assert Ledger.from_dict(ledger.to_dict()).to_dict() == ledger.to_dict()
