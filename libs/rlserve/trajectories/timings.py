"""Where a rollout's seconds go: each service's own compute against the call's wall time (the rest is
plumbing: RPC, serialization, the object store), and the rollout replicas' activity."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlserve.v1 import rollout_pb2

# Replica id -> (uptime_s, idle_s, paused_s, generated_tokens) as a rollout replica last reported it.
Activity = dict[str, tuple[float, float, float, float]]


@dataclass
class BatchTimings:
    generate_s: float = 0.0
    generate_engine_s: float = 0.0
    score_s: float = 0.0
    score_compute_s: float = 0.0
    reference_s: float = 0.0
    reference_compute_s: float = 0.0
    env_s: float = 0.0  # environment calls (Reset, Step) of multi-turn episodes
    # The newest activity each rollout replica reported.
    activity: Activity = field(default_factory=dict)

    def add(self, other: BatchTimings) -> None:
        """Fold in another call's timings (streaming: one per request; the sums are call seconds)."""
        for name in ("generate_s", "generate_engine_s", "score_s", "score_compute_s", "reference_s",
                     "reference_compute_s", "env_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for replica, seen in other.activity.items():
            if seen[0] >= self.activity.get(replica, (-1.0, 0.0, 0.0))[0]:
                self.activity[replica] = seen

    def record_generate(self, resp: rollout_pb2.GenerateResponse, seconds: float) -> None:
        """A Generate call's seconds, the engine's share of them, and the replica's activity."""
        self.generate_s += seconds
        self.generate_engine_s += resp.engine_seconds
        if resp.replica_id:
            self.activity[resp.replica_id] = (resp.activity.uptime_s, resp.activity.idle_s, resp.activity.paused_s,
                                              float(resp.activity.generated_tokens))

    def metrics(self) -> dict[str, float]:
        return {
            **({"timing/env_s": self.env_s} if self.env_s else {}),
            "timing/generate_s": self.generate_s, "timing/reward_s": self.score_s,
            "timing/reference_s": self.reference_s,
            "plumbing/generate_s": self.generate_s - self.generate_engine_s,
            "plumbing/reward_s": self.score_s - self.score_compute_s,
            "plumbing/reference_s": self.reference_s - self.reference_compute_s,
        }
