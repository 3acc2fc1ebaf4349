"""What supervised runs (`algorithm: sft`, `algorithm: dpo`) share: a step takes the next `batch_size`
items at the data cursor, builds one TrainBatch and trains one update at the section's lr, shaped by
`policy.scheduler` (warm-up, then constant or cosine decay over the section's max_num_steps; the spec
refuses `policy.optimizer.kwargs.lr` for these runs, whose lr is the section's).

The ledger counts items (examples, DPO pairs) as an RL run counts trajectories: generated when taken,
trained with the STEP event, dropped as `too_long` when nothing within
`policy.max_total_sequence_length` is left to train. Checkpoints hold the data cursor, so a lost
learner session is mended from the last one like any run's.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlserve.data.dataset import PromptSampler
from rlserve.loop.algorithm import Algorithm, AttemptView
from rlserve.training.batch import TrainBatch
from rlserve.training.schedule import lr_factor
from rlserve.v1 import coordinator_pb2 as pb

TOO_LONG = "too_long"


@dataclass
class SupervisedBatch:
    batch: TrainBatch | None  # None when every item was skipped
    trained: int  # items in the batch
    skipped: int  # items with no trainable token within the length limit
    metrics: dict[str, float] = field(default_factory=dict)


def truncated(ids: list[int], mask: list[bool], max_len: int) -> tuple[list[int], int, list[bool]] | None:
    """(ids cut to max_len, the first trained position, the loss mask from there); None if nothing is left
    to train (position 0 predicts nothing, so training starts at 1 at the earliest)."""
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask[1:]):
        return None
    start = max(1, mask.index(True))
    return ids, start, mask[start:]


class Supervised(Algorithm):
    # The spec section of its settings (max_num_steps, batch_size, lr) and the learner loss it trains with.
    section: ClassVar[str]
    loss: ClassVar[str]

    def __init__(self, attempt: AttemptView):
        super().__init__(attempt)
        spec = attempt.inputs.spec
        self.cfg = getattr(spec, self.section)
        self.sampler = PromptSampler(list(attempt.inputs.train), spec.data.seed)

    @property
    def data_cursor(self) -> int:
        return self.sampler.position

    @abstractmethod
    async def build(self, items: list[Any], max_len: int) -> SupervisedBatch:
        """The TrainBatch of one step's items."""

    def restore(self, data_cursor: int, saved: dict[str, Any]) -> str:
        self.sampler.seek(data_cursor)
        return ""

    async def step(self, step: int) -> dict[str, float]:
        """Take the next items, build the batch, train one update on it."""
        a, cfg = self.attempt, self.cfg
        t0 = time.perf_counter()
        first = self.sampler.position
        items = self.sampler.take(cfg.batch_size)
        max_len = a.inputs.spec.policy.max_total_sequence_length
        built = await self.build(items, max_len)
        a.run.count_generated(len(items))
        if built.skipped:
            a.run.drop(TOO_LONG, built.skipped, f"step {step + 1}: dropped {built.skipped} {self.unit}: {TOO_LONG} "
                       f"(nothing to train within policy.max_total_sequence_length {max_len})")
        metrics = {**built.metrics, "data/cursor": float(first), "batch/trajectories_trained": float(built.trained)}
        if built.batch is None:
            a.run.emit(pb.EVENT_KIND_WARNING, f"step {step + 1} skipped: none of its {len(items)} {self.unit} fits "
                       f"policy.max_total_sequence_length ({max_len})")
            return metrics
        t1 = time.perf_counter()
        schedule = lr_factor(step, a.inputs.spec.policy.scheduler, self.max_steps)
        result = await a.train(built.batch, self.loss, cfg.lr * schedule)
        metrics.update(result.metrics)
        metrics["timing/train_s"] = time.perf_counter() - t1
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics
