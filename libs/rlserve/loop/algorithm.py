"""What an algorithm is to the loop: its data, its step, and a few hooks around them.

The loop (`attempt.py`) owns everything every run does alike: restoring or configuring the learner,
publishing the policy, validation on the algorithm's schedule, recording each step, checkpoints,
and the finish. An algorithm says only what differs. It is registered by name in
`rlserve.catalog.ALGORITHMS`, with the spec section that holds its step count; `algorithm: NAME` in
a spec picks it. Adding one is its module under `rlserve/algorithms/`, its catalog line, and its
test (vLLM's executor/worker split: the loop dispatches, the algorithm computes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from rlserve.catalog import ALGORITHMS
from rlserve.config import RunSpec
from rlserve.loop.inputs import LoopSettings, RunInputs
from rlserve.loop.services import RunServices
from rlserve.loop.state import LoopState
from rlserve.loop.sync import WeightSync
from rlserve.registry import import_object
from rlserve.runs.record import Run
from rlserve.training.batch import TrainBatch
from rlserve.v1 import learner_pb2


def algorithm_class(spec: RunSpec) -> type[Algorithm]:
    """The class registered for `spec.algorithm`."""
    return import_object(ALGORITHMS[spec.algorithm].impl)


class AttemptView(Protocol):
    """What an algorithm sees of the attempt it serves (`rlserve.loop.attempt.Attempt`)."""

    inputs: RunInputs
    run: Run
    services: RunServices
    settings: LoopSettings
    state: LoopState
    sync: WeightSync

    def progress(self) -> None:
        """The run made progress (the watchdog's clock)."""

    async def train(self, batch: TrainBatch, loss_name: str,
                    learning_rate: float | None = None) -> learner_pb2.TrainStepResponse:
        """One optimizer step of the run's learner session (the loop state's version follows it)."""


class Algorithm(ABC):
    """One kind of run. Built once per attempt, around the attempt it serves."""

    # What its steps count in the ledger ("trajectories", "examples", "pairs"), for messages.
    unit: ClassVar[str]
    # It samples from the policy while it trains: the engines must serve the policy from the start.
    samples_from_policy: ClassVar[bool] = False
    # Its data are preference pairs (a preference file), not prompts with answers.
    trains_on_pairs: ClassVar[bool] = False

    def __init__(self, attempt: AttemptView):
        self.attempt = attempt

    @classmethod
    @abstractmethod
    def data(cls, spec: RunSpec) -> tuple[Sequence[Any], Sequence[Any]]:
        """(what the steps take in order, the held-out examples validation scores); built off the event loop."""

    @property
    def max_steps(self) -> int:
        return self.attempt.inputs.spec.max_num_steps

    @property
    @abstractmethod
    def data_cursor(self) -> int:
        """Where the next step takes its data: what a checkpoint saves and a restore seeks to."""

    async def prepare(self) -> Path:
        """Before a fresh start configures the learner: the policy it starts from (the model, or what a warm
        start made of it)."""
        return self.attempt.inputs.model_path

    async def background(self) -> list[Coroutine[Any, Any, None]]:
        """Work to run beside the steps (an RL run's producer), once setup is done; its failure ends the
        attempt."""
        return []

    @abstractmethod
    async def step(self, step: int) -> dict[str, float]:
        """Step `step` (0-based): its metrics, `batch/trajectories_trained` among them."""

    def validates_at_start(self) -> bool:
        """Whether a fresh start validates the initial policy (the run's baseline)."""
        return False

    def validation_due(self, steps_done: int) -> bool:
        """Whether the loop validates after `steps_done` steps (the last one included)."""
        return False

    def after_step(self, steps_done: int, version: int) -> None:
        """The step is recorded (before its checkpoint): let work beside the steps go on."""

    def stop_reason(self, metrics: dict[str, float]) -> str:
        """Non-empty: the run stops after this step, and this says why."""
        return ""

    def checkpoint_state(self) -> dict[str, Any]:
        """The algorithm's own part of a checkpoint (JSON), beside the loop's `CheckpointState`."""
        return {}

    def restore(self, data_cursor: int, saved: dict[str, Any]) -> str:
        """Continue from a checkpoint's data cursor and the algorithm's part of it; returns what to say about
        it in the RECOVERED event ("" for nothing)."""
        return ""
