"""Train/validation splits and a resumable prompt sampler."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from rlserve.config.spec import FILE_TASKS, DataCfg
from rlserve.data.files import load_examples
from rlserve.data.tasks import Example, get_task


@dataclass(frozen=True)
class Splits:
    train: list[Example]
    val: list[Example]


def _key(ex: Example) -> str:
    """What makes two examples the same: the prompt, and the environment's arguments if any."""
    return ex.prompt if not ex.env_args else f"{ex.prompt}\0{json.dumps(ex.env_args, sort_keys=True)}"


def build_splits(cfg: DataCfg, max_train: int | None = None) -> Splits:
    """Validation prompts first, then training prompts that never repeat a validation prompt.

    `max_train` builds only that many generated training examples (the first ones the full build
    would give), for checks that need a sample and must stay cheap; data files are read whole
    (their size is bounded where the spec names them).
    """
    if cfg.task in FILE_TASKS:
        train = load_examples(cfg.train_path, cfg)
        if cfg.val_path:
            return Splits(train, load_examples(cfg.val_path, cfg)[: cfg.num_val])
        rng = random.Random(cfg.seed)
        shuffled = train[:]
        rng.shuffle(shuffled)
        n_val = min(cfg.num_val, max(1, len(shuffled) // 10))
        return Splits(shuffled[n_val:], shuffled[:n_val])
    task = get_task(cfg.task, cfg.task_args)
    rng = random.Random(cfg.seed)
    val: dict[str, Example] = {}
    attempts = 0
    while len(val) < cfg.num_val and attempts < 50 * cfg.num_val:
        ex = task.example(rng)
        val.setdefault(_key(ex), ex)
        attempts += 1
    train: list[Example] = []
    attempts = 0
    wanted = cfg.num_train if max_train is None else min(cfg.num_train, max_train)
    while len(train) < wanted and attempts < 50 * wanted:
        ex = task.example(rng)
        if not task.held_out or _key(ex) not in val:
            train.append(ex)
        attempts += 1
    if not train:
        raise ValueError(f"task {cfg.task!r} with {cfg.task_args} leaves no training prompts beside the "
                         f"{len(val)} validation prompts; lower data.num_val")
    return Splits(train, list(val.values()))


class PromptSampler:
    """Shuffled passes over the training examples; its position is checkpointable."""

    def __init__(self, examples: list[Example], seed: int):
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    @property
    def position(self) -> int:
        """Examples taken so far over all passes: the data cursor."""
        return self.epoch * len(self.examples) + self.index

    def seek(self, position: int) -> None:
        """Continue as if `position` examples had been taken (the order of every pass is fixed by the seed)."""
        if position < 0:
            raise ValueError(f"data cursor must be >= 0, got {position}")
        self.epoch, self.index = divmod(position, len(self.examples))
        self._order = self._shuffle(self.epoch)
