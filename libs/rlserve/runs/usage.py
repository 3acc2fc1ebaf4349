"""What a run spent: tokens generated and trained, and generation and training device-seconds.

Each STEP event carries its step's spend as `usage/*` metrics (the producer
counts generated tokens, the trainer the engines' busy seconds, the learner
the tokens it trained on and its seconds times its ranks; an SFT warm start's
VALIDATION events carry its steps' since the last one). A run's usage is the
sum over its events, so it is what the event log says, like the ledger: a
restarted coordinator rebuilds it from events.jsonl, and a step done twice
after a recovery is counted twice, because it was spent twice.

Generation device-seconds are the engines' busy time between two steps
(validation generation included). A run that trains alone has that time to
itself; LoRA runs that share the engines (`RunSpec.shares_deployed_base`) are
each charged their share of it by tokens: the tokens the run generated over
the tokens the engines generated meanwhile (`trainer.engine_idle`). Learner
seconds are the run's own calls' (runs sharing the learner's workers take
turns), times its ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields

from rlserve.v1 import coordinator_pb2 as pb

# The event metrics a run's usage sums, and the field each one adds to.
STEP_METRICS = {
    "usage/generated_tokens": "generated_tokens",
    "usage/trained_tokens": "trained_tokens",
    "usage/generation_device_s": "generation_device_seconds",
    "usage/training_device_s": "training_device_seconds",
}


@dataclass
class Usage:
    generated_tokens: int = 0  # completion tokens the policy generated (dropped samples too)
    trained_tokens: int = 0  # tokens the learner trained on (prompts and completions)
    generation_device_seconds: float = 0.0
    training_device_seconds: float = 0.0

    def add_step(self, metrics: Mapping[str, float]) -> None:
        for key, name in STEP_METRICS.items():
            value = metrics.get(key, 0.0)
            setattr(self, name, getattr(self, name) + (int(value) if name.endswith("tokens") else float(value)))

    def add(self, other: Usage) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def from_events(cls, events: Iterable[pb.RunEvent]) -> Usage:
        usage = cls()
        for ev in events:
            usage.add_step(dict(ev.metrics))
        return usage

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def to_proto(self) -> pb.Usage:
        return pb.Usage(**asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.Usage) -> Usage:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})
