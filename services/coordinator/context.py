"""What one run's tasks (producer, trainer, watchdog, checkpoints, SFT, weight sync) share.

A Context lives for one attempt of a run: a recovery builds a fresh one (empty
queue, sampler at the checkpoint's cursor) around the same Run and ServiceCalls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from rlserve.data.dataset import PromptSampler, build_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.models import resolve_model
from services.coordinator.calls import RetryPolicy, ServiceCalls
from services.coordinator.groups import GroupQueue
from services.coordinator.runs import Run
from services.coordinator.staleness import StalenessBound


@dataclass(frozen=True)
class LoopSettings:
    apps: dict[str, str]
    weight_store: str
    retry: RetryPolicy
    watchdog_timeout_s: float


class Context:
    def __init__(self, run: Run, calls: ServiceCalls, settings: LoopSettings):
        spec = run.spec
        self.run, self.spec, self.calls, self.settings = run, spec, calls, settings
        self.model_path = resolve_model(spec.policy.model_name, spec.policy.model_seed)
        self.tok = PromptTokenizer(self.model_path, spec.data.prompt_format, spec.data.system_prompt)
        self.splits = build_splits(spec.data)
        self.val_examples = self.splits.val[: spec.grpo.max_val_samples]
        # Step k's prompts are the data cursor's [k * P, (k + 1) * P) (P = num_prompts_per_step).
        self.sampler = PromptSampler(self.splits.train, spec.data.seed)
        self.queue = GroupQueue()
        self.staleness = StalenessBound(spec.grpo.max_age)
        # The GRPO phase starts from this policy (the SFT output when warm-starting); it is also the reference.
        self.init_model = self.model_path
        self.produced_steps = 0  # steps whose groups are in the queue or trained
        self.trainer_step = 0  # steps the trainer has finished (trained or skipped)
        self.trainer_moved = asyncio.Condition()
        self.reward_version: str | None = None
        self.timings: dict[int, dict[str, float]] = {}
        # The newest engine activity of each rollout replica (replica id -> (uptime_s, idle_s,
        # paused_s)), and what it was at the previous training step.
        self.engine_activity: dict[str, tuple[float, float, float]] = {}
        self.activity_mark: dict[str, tuple[float, float, float]] = {}
        self.last_progress = time.monotonic()
        self.initial_val: float | None = None
        self.checkpoints_saved = 0
        # When this attempt follows a loss of state: since when (monotonic), for the RECOVERED event.
        self.recovering_since: float | None = None

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def emit(self, kind: int, message: str, metrics: dict[str, float] | None = None) -> None:
        self.run.emit(kind, message, metrics)
