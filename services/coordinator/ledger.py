"""Where every trajectory of a run went: generated, scored, trained, or dropped with a reason.

The ledger balances at every moment: generated == trained + dropped + in flight
(scored is a stage on the way, not an end). A fault can then be shown to lose
nothing: what is neither trained nor dropped is still in flight.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rlserve.v1 import coordinator_pb2


@dataclass
class Ledger:
    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)

    @property
    def in_flight(self) -> int:
        return self.generated - self.trained - sum(self.dropped.values())

    def drop(self, reason: str, n: int) -> None:
        if n < 0 or n > self.in_flight:
            raise ValueError(f"cannot drop {n} trajectories ({reason}): only {self.in_flight} in flight")
        self.dropped[reason] += n

    def train(self, n: int) -> None:
        if n > self.in_flight:
            raise ValueError(f"cannot train {n} trajectories: only {self.in_flight} in flight")
        self.trained += n

    def balanced(self) -> bool:
        return self.in_flight == 0

    def to_proto(self) -> coordinator_pb2.Ledger:
        return coordinator_pb2.Ledger(generated=self.generated, scored=self.scored, trained=self.trained,
                                      dropped=dict(self.dropped), in_flight=self.in_flight)

    def to_dict(self) -> dict:
        return {"generated": self.generated, "scored": self.scored, "trained": self.trained,
                "dropped": dict(self.dropped)}

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        return cls(d["generated"], d["scored"], d["trained"], Counter(d["dropped"]))
