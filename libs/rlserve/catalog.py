"""Every registry of rlserve in one low-level place: each kind's built-in names and where their code lives.

The run spec (`rlserve.config`) validates names against these registries and the
packages that own the code (algorithms/, learner/, rollout/, environments/,
rewards/, data/) build what the names name from them, so neither side imports
the other. This module imports nothing of rlserve above `rlserve.registry`
(tests/unit/test_layering.py holds it to that), and its entries are
"module:attribute" strings imported on use, so validating a spec loads no torch.

Adding a built-in is its module, its line here and its test. The open
registries (those with an entry-point group) also take a user's entries: a
package's entry points in the group, or a "module:attribute" the cluster file
names, each only when the cluster file's `plugins` section (`PluginsCfg`)
enables it (`rlserve.registry`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from rlserve.registry import PLUGINS_ENV, Registry

# Losses: `loss_fn.name` (and the SFT warm start's and `algorithm: sft` / `dpo` runs' own), built as
# Class(its spec section) (`rlserve.algorithms.interfaces.Loss`, `rlserve.algorithms.registry`).
LOSSES = Registry("loss", {
    "grpo": "rlserve.algorithms.losses.grpo:GrpoLoss",
    "cispo": "rlserve.algorithms.losses.cispo:CispoLoss",
    "sft": "rlserve.algorithms.losses.sft:SftLoss",
    "dpo": "rlserve.algorithms.losses.dpo:DpoLoss",
}, "rlserve.losses")
# Losses that train on data, not on rewards (the SFT warm start's, `algorithm: sft` and `dpo` runs'),
# never a GRPO run's `loss_fn.name`.
SUPERVISED_LOSSES = ("sft", "dpo")

# Advantage estimators: `grpo.adv_estimator.name`, built as Class(grpo.adv_estimator, loss_fn)
# (`rlserve.algorithms.interfaces.AdvantageEstimator`).
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", {
    "grpo": "rlserve.algorithms.advantages.grpo:GrpoAdvantageEstimator",
    "reinforce_plus_plus": "rlserve.algorithms.advantages.reinforce_plus_plus:ReinforcePlusPlusAdvantageEstimator",
    "on_policy_distillation":
        "rlserve.algorithms.advantages.distillation:OnPolicyDistillationAdvantageEstimator",
}, "rlserve.advantage_estimators")

# Environments: `env.name` (and an EnvironmentSpec's), an `Environment` subclass built with `env.args`
# as keyword arguments (`rlserve.environments.loader`; the built-ins that score with reward functions
# are built with them, `rlserve.environments.config.SCORED`).
ENVIRONMENTS = Registry("environment", {
    "single_turn": "rlserve.environments.builtins:SingleTurn",
    "guess_number": "rlserve.environments.builtins:GuessNumber",
    "tool_use": "rlserve.environments.tool_use:ToolUse",
}, "rlserve.environments")

# Reward functions: `reward.functions[].name` without an import_path, a `RewardFunction` class built
# with `args` as keyword arguments, or a plain function (`rlserve.rewards.loader`).
REWARD_FUNCTIONS = Registry("reward function", {
    "exact_match": "rlserve.rewards.builtins:ExactMatch",
    "math_verify": "rlserve.rewards.math_answers:MathVerify",
    "format": "rlserve.rewards.builtins:FormatReward",
    "length_penalty": "rlserve.rewards.builtins:LengthPenalty",
    "countdown": "rlserve.rewards.builtins:Countdown",
    "reward_model": "rlserve.rewards.reward_model:SequenceClassifierReward",
    "llm_judge": "rlserve.rewards.judge:LlmJudge",
}, "rlserve.reward_functions")
# Reward functions that load the model folder their `args.model` names: the folder must be on the
# cluster's allow-list (`rlserve.security.plugins`).
MODEL_BACKED_REWARDS = frozenset({"reward_model", "llm_judge"})

# Synthetic tasks: `data.task`, a `rlserve.data.tasks.Task` subclass (its `Args` are `data.task_args`).
TASKS = Registry("task", {
    "addition": "rlserve.data.tasks:Addition",
    "multiplication": "rlserve.data.tasks:Multiplication",
    "countdown": "rlserve.data.tasks:Countdown",
    "reverse": "rlserve.data.tasks:Reverse",
    "sort": "rlserve.data.tasks:Sort",
    "guess_number": "rlserve.data.tasks:GuessNumber",
    "tool_multiplication": "rlserve.data.tasks:ToolMultiplication",
}, "rlserve.tasks")

# Rollout engines: the rollout service's `args.engine` (and `policy.generation.backend`), a callable
# (EngineConfig) -> RolloutEngine (`rlserve.rollout.registry`).
ROLLOUT_ENGINES = Registry("rollout engine", {
    "vllm": "rlserve.rollout.vllm_engine:VllmEngine",
    "transformers": "rlserve.rollout.registry:transformers_engine",
    "auto": "rlserve.rollout.registry:auto_engine",
}, "rlserve.rollout_engines")


@dataclass(frozen=True)
class BackendEntry:
    # "module:Class" of the LearnerBackend, built as Class(spec, model_path, device, init_adapter[, shared]).
    backend: str
    # "module:function" (spec, hf_config) -> None that raises UnsupportedModel for a model the
    # backend cannot train as the spec configures it; the backend obeys the same reasons.
    check_model: str


# Learner backends: the one whose `policy.<name>_cfg.enabled` is set (`rlserve.learner.registry`). Closed:
# a backend is configured by a spec section of its own, which a plug-in cannot add.
LEARNER_BACKENDS = Registry("learner backend", {
    "dtensor": BackendEntry("rlserve.learner.dtensor.backend:DTensorBackend",
                            "rlserve.learner.dtensor.support:check_model"),
    "megatron": BackendEntry("rlserve.learner.megatron.backend:MegatronBackend",
                             "rlserve.learner.megatron.support:check_model"),
})
# The backend of a spec that enables no other.
DEFAULT_BACKEND = "dtensor"


@dataclass(frozen=True)
class AlgorithmEntry:
    # "module:Class" of the `rlserve.loop.algorithm.Algorithm`.
    impl: str
    # The spec section that holds its max_num_steps and its settings.
    section: str
    # It samples from the policy while it trains (an RL run): LoRA runs of it may share the deployed base.
    samples_from_policy: bool


# Algorithms: a spec's `algorithm`, what the loop (`rlserve.loop.attempt`) runs at each step. Closed: each
# has a spec section of its own.
ALGORITHMS = Registry("algorithm", {
    "grpo": AlgorithmEntry("rlserve.algorithms.grpo:Grpo", "grpo", True),
    "distillation": AlgorithmEntry("rlserve.algorithms.distillation:Distillation", "grpo", True),
    "sft": AlgorithmEntry("rlserve.algorithms.sft:Sft", "sft", False),
    "dpo": AlgorithmEntry("rlserve.algorithms.dpo:Dpo", "dpo", False),
})

# The registries a user's package may add to, by entry-point group.
OPEN_REGISTRIES: dict[str, Registry] = {r.group: r for r in (
    LOSSES, ADVANTAGE_ESTIMATORS, ENVIRONMENTS, REWARD_FUNCTIONS, TASKS, ROLLOUT_ENGINES)}

PackageName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)]
EntryName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$", max_length=64)]
ImportPath = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", max_length=500)]


class PluginsCfg(BaseModel):
    """The cluster file's `plugins`: what the cluster loads beyond rlserve's built-ins. Nothing of an
    installed package is used unless it is listed here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Distributions (pip names) whose entry points in rlserve's groups (rlserve.losses,
    # rlserve.advantage_estimators, rlserve.environments, rlserve.reward_functions, rlserve.tasks,
    # rlserve.rollout_engines) the cluster may use; each must be installed on every node.
    packages: list[PackageName] = Field([], max_length=64)
    # Entries without a package: group -> name -> "module:attribute", importable on every node,
    # e.g. {rlserve.losses: {my_loss: "my_pkg.losses:MyLoss"}}.
    entries: dict[str, dict[EntryName, ImportPath]] = {}

    @model_validator(mode="after")
    def _known_groups(self) -> PluginsCfg:
        for group, names in self.entries.items():
            registry = OPEN_REGISTRIES.get(group)
            if registry is None:
                raise ValueError(f"plugins.entries.{group}: not a registry's group; valid: "
                                 f"{', '.join(OPEN_REGISTRIES)}")
            for name in names:
                if name in registry.builtins:
                    raise ValueError(f"plugins.entries.{group}.{name}: the name of a built-in {registry.kind}")
        if len(set(self.packages)) != len(self.packages):
            raise ValueError(f"plugins.packages: listed twice: {self.packages}")
        return self

    def env(self) -> dict[str, str]:
        """The environment variable that carries this section to a process of the cluster (none when empty)."""
        if not self.packages and not self.entries:
            return {}
        return {PLUGINS_ENV: json.dumps(self.model_dump(mode="json"), sort_keys=True)}
