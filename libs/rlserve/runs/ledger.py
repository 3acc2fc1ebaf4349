"""Where every trajectory of a run went: generated, scored, trained, or dropped with a reason.

The ledger balances at every moment: generated == trained + dropped + in flight
(scored is a stage on the way, not an end). A fault can then be shown to lose
nothing: what is neither trained nor dropped is still in flight, and a run that
ends (succeeded, failed, cancelled) has nothing in flight.

Every change is announced: DROPPED events carry `dropped/<reason>`, STEP events
`batch/trajectories_trained`, and a RECOVERED event the changes of a rewind
(`rewind`), so the counts can be checked against the event log.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from rlserve.v1 import coordinator_pb2

RECOVERED = "recovered"


@dataclass
class Ledger:
    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)

    @property
    def in_flight(self) -> int:
        return self.generated - self.trained - sum(self.dropped.values())

    def generate(self, n: int) -> None:
        """n trajectories generated and scored (one call returns both)."""
        self.generated += n
        self.scored += n

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

    def rewind(self, checkpoint: Ledger) -> tuple[Ledger, dict[str, float]]:
        """The ledger after the run went back to `checkpoint`, and what changed (for the RECOVERED event).

        Generated stays what it is (those trajectories did exist); what was trained or dropped after
        the checkpoint is undone with the training it went into, and everything generated after the
        checkpoint is dropped as `recovered` (the redone steps generate their own). What the
        checkpoint held in flight (its buffered groups) is in flight again.
        """
        if checkpoint.generated > self.generated:
            raise ValueError(f"the checkpoint's ledger ({checkpoint.generated} generated) is ahead of the run's "
                             f"({self.generated})")
        after = Ledger(self.generated, self.scored, checkpoint.trained, Counter(checkpoint.dropped))
        after.dropped[RECOVERED] += self.generated - checkpoint.generated
        changes: dict[str, float] = {}
        for reason in sorted(set(self.dropped) | set(after.dropped)):
            delta = after.dropped[reason] - self.dropped[reason]
            if delta:
                changes[f"dropped/{reason}"] = float(delta)
        if after.trained != self.trained:
            changes["trained"] = float(after.trained - self.trained)
        after.dropped = +after.dropped  # no zero entries
        return after, changes

    def as_announced(self, events: Iterable[coordinator_pb2.RunEvent]) -> Ledger:
        """This ledger (as run.json saved it) with trained and dropped summed from the event log.

        Each change is appended to events.jsonl as it happens; run.json is rewritten only after a
        step, so a coordinator killed in between (while it checkpoints, say) leaves run.json behind
        the events. The events are the record. Generated has no event: the producer saves run.json
        right after counting it, and it is never less than what the events account for.
        """
        trained, dropped = 0, Counter()
        for ev in events:
            if ev.kind == coordinator_pb2.EVENT_KIND_STEP:
                trained += int(ev.metrics.get("batch/trajectories_trained", 0))
            elif ev.kind == coordinator_pb2.EVENT_KIND_RECOVERED:
                trained += int(ev.metrics.get("trained", 0))
            if ev.kind in (coordinator_pb2.EVENT_KIND_DROPPED, coordinator_pb2.EVENT_KIND_RECOVERED):
                dropped.update({k.removeprefix("dropped/"): int(v) for k, v in ev.metrics.items()
                                if k.startswith("dropped/")})
        generated = max(self.generated, trained + sum(dropped.values()))
        return Ledger(generated, self.scored + generated - self.generated, trained, +dropped)

    def to_proto(self) -> coordinator_pb2.Ledger:
        return coordinator_pb2.Ledger(generated=self.generated, scored=self.scored, trained=self.trained,
                                      dropped=dict(self.dropped), in_flight=self.in_flight)

    def to_dict(self) -> dict:
        return {"generated": self.generated, "scored": self.scored, "trained": self.trained,
                "dropped": dict(self.dropped)}

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        return cls(d["generated"], d["scored"], d["trained"], Counter(d["dropped"]))
