"""What a run's loop is given and never changes: the resolved spec, the model, the tokenizer, the data.

The spec arrives parsed and resolved (SubmitRun read it once; the run record carries it) and travels
on as the object itself, to the learner too: nothing reads it back from disk or parses it again.
`RunInputs` is built once per attempt, off the event loop (building a data set takes a while).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlserve.config import RunSpec
from rlserve.data.prompts import PromptTokenizer
from rlserve.models import resolve_model


@dataclass(frozen=True)
class LoopSettings:
    """The cluster's settings every run's loop obeys (the coordinator's args)."""

    weight_store: str
    watchdog_timeout_s: float
    # The cluster's generation runs on the CPU, on cores a CPU learner also uses (async_grpo.enabled: auto).
    generation_shares_cpu_cores: bool = False


@dataclass(frozen=True)
class RunInputs:
    run_id: str
    spec: RunSpec
    run_dir: Path
    model_path: Path
    tok: PromptTokenizer
    # What the steps take in order (examples, or a DPO run's preference pairs) and the held-out examples
    # validation scores (none for DPO).
    train: tuple[Any, ...]
    val: tuple[Any, ...]

    @classmethod
    def build(cls, run_id: str, spec: RunSpec, run_dir: Path,
              data: Callable[[RunSpec], tuple[Sequence[Any], Sequence[Any]]]) -> RunInputs:
        """`data`: the algorithm's (`Algorithm.data`): what its steps take, and the held-out examples."""
        model_path = resolve_model(spec.policy.model_name, spec.policy.model_seed)
        tok = PromptTokenizer(model_path, spec.data.prompt_format, spec.data.system_prompt)
        train, val = data(spec)
        return cls(run_id, spec, run_dir, model_path, tok, tuple(train), tuple(val))
