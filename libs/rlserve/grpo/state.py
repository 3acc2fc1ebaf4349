"""A run's loop state, split by who writes it.

- `RunInputs`: what the run is given and never changes (spec, model, tokenizer,
  data). Built once per attempt, off the event loop (building a data set takes
  a while).
- `ProducerState`: written only by the producer (and by a checkpoint restore
  before the producer starts): the data cursor and what it has generated.
- `TrainerState`: written only by the trainer (and by setup and restore before
  it starts): the step it is at and the validation baseline.

The two loops meet only in the `StepQueue` (`groups.py`). Two runs are two
sets of these objects and share nothing mutable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlserve.config import RunSpec, spec_to_yaml
from rlserve.data.dataset import PromptSampler, build_splits
from rlserve.data.preferences import PreferenceSplits, build_preference_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.models import resolve_model

# Replica id -> (uptime_s, idle_s, paused_s, generated_tokens) as a rollout replica last reported it.
Activity = dict[str, tuple[float, float, float, float]]


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
    train: tuple[Example, ...]
    val: tuple[Example, ...]  # the held-out prompts validation scores (at most grpo.max_val_samples)
    # An algorithm: dpo run's preference pairs (its train and val are empty).
    pairs: PreferenceSplits | None = None
    # On-policy distillation: the teacher's HF folder (the reference service scores with it).
    teacher_path: Path | None = None

    @classmethod
    def build(cls, run_id: str, spec: RunSpec, run_dir: Path) -> RunInputs:
        model_path = resolve_model(spec.policy.model_name, spec.policy.model_seed)
        tok = PromptTokenizer(model_path, spec.data.prompt_format, spec.data.system_prompt)
        if spec.algorithm == "dpo":
            return cls(run_id, spec, run_dir, model_path, tok, (), (), build_preference_splits(spec.data))
        splits = build_splits(spec.data)
        teacher = spec.teacher
        return cls(run_id, spec, run_dir, model_path, tok, tuple(splits.train),
                   tuple(splits.val[: spec.grpo.max_val_samples]),
                   teacher_path=resolve_model(teacher.model_name, teacher.model_seed) if teacher.model_name else None)

    def spec_yaml(self) -> str:
        """The resolved spec as SubmitRun wrote it into the run directory (what the learner is configured with)."""
        return (self.run_dir / "spec.yaml").read_text()

    def sft_spec_yaml(self) -> str:
        """The spec the SFT warm start configures the learner with: full-parameter even in a LoRA run, whose
        adapters then train on the SFT model (its base and reference policy)."""
        if not self.spec.policy.lora.enabled:
            return self.spec_yaml()
        spec = self.spec.model_copy(deep=True)
        spec.policy.lora.enabled = False
        return spec_to_yaml(spec)


@dataclass
class ProducerState:
    # Steps take prompts at the data cursor in order: P = num_prompts_per_step each, or with dynamic
    # sampling as many generation batches as the step needs.
    sampler: PromptSampler
    produced_steps: int = 0  # steps whose groups are in the queue or trained
    data_cursor: int = 0  # the data cursor after the last committed step's prompts
    reward_version: str | None = None
    activity: Activity = field(default_factory=dict)  # the newest activity of each rollout replica


@dataclass
class TrainerState:
    # The GRPO phase starts from this policy (the SFT output when warm-starting); it is also the reference.
    init_model: Path
    step: int = 0  # steps finished (trained or skipped)
    initial_val: float | None = None
    checkpoints_saved: int = 0
    activity_mark: Activity = field(default_factory=dict)  # engine activity at the previous step
