"""The staleness bound of the async loop, in one unit: weight versions.

A trajectory generated under weight version `g` and trained by a learner at
version `v` is `v - g` versions old; it may be trained only if that age is at
most `max_age` (`grpo.async_grpo.max_trajectory_age_steps`, 0 when async is
off). The producer's gate uses the same unit: the trainer consumes batches in
order and each batch moves the policy by at most one version (a batch that
trains nothing moves it by none), so a batch whose generation starts with
`batches_ahead` unconsumed batches before it is at most `batches_ahead`
versions old when it is trained. Gating on that worst case keeps every batch
fresh however many steps train nothing; the trainer's check is still applied
(and anything too old is dropped with reason `stale`, never trained).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    max_age: int

    def age(self, trainer_version: int, generated_version: int) -> int:
        return trainer_version - generated_version

    def is_fresh(self, trainer_version: int, generated_version: int) -> bool:
        return self.age(trainer_version, generated_version) <= self.max_age

    def may_generate(self, batches_ahead: int) -> bool:
        """Whether a batch may start generating with `batches_ahead` batches not yet consumed before it."""
        return batches_ahead <= self.max_age
