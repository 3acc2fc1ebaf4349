"""The run spec: one YAML document that says everything about a run.

Key names follow NeMo-RL's config (`policy.*`, `grpo.*`, `loss_fn.*`,
`data.*`, `checkpointing.*`, `logger.*`) so a NeMo-RL user feels at home. The
`policy` section (model, optimizer, learner backend, generation) lives in
`policy.py`, the sections that choose and tune the algorithm (advantages, loss,
reward shaping, SFT, DPO) in `algorithms.py`, the base class of every section
in `section.py`. Every default lives on the classes; call sites read fields
and never pass their own fallbacks. Unknown keys are errors (see `rlserve.config.errors`).

Every size has an upper bound and every float must be finite: a spec comes
from a request, and validating it must be cheap and must not admit a run that
cannot fit the machine or the proto fields that report it (a `max_num_steps`
of 2**70 once made every later ListRuns fail).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rlserve.agents.config import EXTERNAL_AGENT, ExternalAgentArgs
from rlserve.catalog import ALGORITHMS, ENVIRONMENTS, TASKS
from rlserve.config.algorithms import AdvEstimatorCfg, DpoCfg, LossFnCfg, RewardShapingCfg, SftCfg
from rlserve.config.policy import PolicyCfg, Seed
from rlserve.config.section import (
    MAX_EXAMPLES,
    MAX_GENERATIONS_PER_PROMPT,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_PRIORITY,
    MAX_PROMPTS_PER_STEP,
    MAX_ROLLOUT_TURNS,
    MAX_STEPS,
    MAX_SYSTEM_PROMPT_CHARS,
    MAX_TRAJECTORIES_PER_STEP,
    MAX_VAL_EXAMPLES,
    MAX_WORKERS,
    NAME_PATTERN,
    Section,
)
from rlserve.environments.config import SCORED, EnvironmentCfg
from rlserve.rewards.config import RewardFunctionCfg


class AsyncGrpoCfg(Section):
    # auto: async, unless generation and training share CPU cores (a CPU-only cluster whose rollout
    # engine and learner are not pinned to cores of their own): there they take turns on the same
    # cores, and async measured slower than sync (BENCHMARKS.md, "rlserve against TRL").
    enabled: bool | Literal["auto"] = False
    # How many weight versions a trajectory may lag the learner (0: on-policy); a sample's age is
    # that of the oldest version any of its tokens was generated under.
    max_trajectory_age_steps: int = Field(1, ge=0, le=64)
    # New weights reach requests already generating (pause with requests kept, load, resume): a
    # sample may then span versions, its logprobs those it was sampled with. Off: running requests
    # finish on the old weights before the update, so every sample comes from one version.
    in_flight_weight_updates: bool = False
    # Streaming: small requests (`prompts_per_request` prompts), each scored as soon as its samples
    # finish, and the next step's prompts submitted while the current step's last groups still
    # generate (within the staleness bound). Off: one request per step.
    streaming: bool = False
    # Prompts generating at once when streaming.
    max_prompts_in_flight: int = Field(64, ge=1, le=MAX_PROMPTS_PER_STEP)
    # Prompts per request when streaming (1: every group on its own; larger: fewer calls).
    prompts_per_request: int = Field(8, ge=1, le=MAX_PROMPTS_PER_STEP)


# grpo.* keys of earlier specs, now under grpo.adv_estimator.
LEGACY_ADV_ESTIMATOR_KEYS = ("normalize_rewards", "use_leave_one_out_baseline")


class GrpoCfg(Section):
    num_prompts_per_step: int = Field(32, ge=1, le=MAX_PROMPTS_PER_STEP)
    num_generations_per_prompt: int = Field(8, ge=1, le=MAX_GENERATIONS_PER_PROMPT)
    max_num_steps: int = Field(100, ge=1, le=MAX_STEPS)
    adv_estimator: AdvEstimatorCfg = AdvEstimatorCfg()
    # Groups whose rewards are all equal carry no signal; drop them (counted in the ledger).
    skip_zero_advantage_groups: bool = True
    # DAPO's dynamic sampling (`trajectories/producer.py`): the producer drops groups whose task
    # rewards are all equal and generates more prompts, batch_multiplier x num_prompts_per_step at a
    # time, until the step has num_prompts_per_step groups that carry signal, at most
    # dynamic_sampling_max_gen_batches batches (then the step trains what it has, with a WARNING).
    use_dynamic_sampling: bool = False
    batch_multiplier: float = Field(1.0, ge=1, le=64)
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1, le=1000)
    reward_shaping: RewardShapingCfg = RewardShapingCfg()
    val_period: int = Field(10, ge=0, le=MAX_STEPS)
    val_at_start: bool = True
    max_val_samples: int = Field(128, ge=1, le=MAX_VAL_EXAMPLES)
    # Validation decodes greedily so that before/after numbers are comparable.
    val_greedy: bool = True
    seed: Seed = 42
    async_grpo: AsyncGrpoCfg = AsyncGrpoCfg()
    # Turns of an episode at most (NeMo-RL's key): generate -> environment step -> observation,
    # until the environment says done, this many turns, or policy.max_total_sequence_length tokens.
    # More than 1 needs an environment (env.enabled).
    max_rollout_turns: int = Field(1, ge=1, le=MAX_ROLLOUT_TURNS)

    @model_validator(mode="before")
    @classmethod
    def _legacy_adv_estimator_keys(cls, data: Any) -> Any:
        """`grpo.normalize_rewards` / `grpo.use_leave_one_out_baseline` move into `grpo.adv_estimator`."""
        if not isinstance(data, dict) or not any(k in data for k in LEGACY_ADV_ESTIMATOR_KEYS):
            return data
        estimator = data.get("adv_estimator", {})
        if not isinstance(estimator, dict):
            return data  # not a mapping: validation reports it (and the legacy keys as unknown)
        for key in LEGACY_ADV_ESTIMATOR_KEYS:
            if key in data and key in estimator:
                raise ValueError(f"grpo.{key}: given twice, here and as grpo.adv_estimator.{key}; keep "
                                 f"grpo.adv_estimator.{key}")
        moved = {k: data[k] for k in LEGACY_ADV_ESTIMATOR_KEYS if k in data}
        rest = {k: v for k, v in data.items() if k not in LEGACY_ADV_ESTIMATOR_KEYS}
        return {**rest, "adv_estimator": {**estimator, **moved}}

    @property
    def gen_batch_prompts(self) -> int:
        """Prompts per generation batch: a step's one batch, or each of dynamic sampling's."""
        if not self.use_dynamic_sampling:
            return self.num_prompts_per_step
        return int(self.batch_multiplier * self.num_prompts_per_step)

    def async_on(self, cores_shared: bool) -> bool:
        """Whether generation runs ahead of training; `cores_shared`: generation and training would share
        CPU cores (what `enabled: auto` decides on)."""
        enabled = self.async_grpo.enabled
        return not cores_shared if enabled == "auto" else enabled

    def max_age(self, cores_shared: bool) -> int:
        """The staleness bound in force (0 when async is off)."""
        return self.async_grpo.max_trajectory_age_steps if self.async_on(cores_shared) else 0


class DataColumnsCfg(Section):
    """The data file's column for each field (HF `datasets` files keep their own names)."""

    prompt: str = Field("prompt", min_length=1, max_length=MAX_NAME_CHARS)
    messages: str = Field("messages", min_length=1, max_length=MAX_NAME_CHARS)
    answer: str = Field("answer", min_length=1, max_length=MAX_NAME_CHARS)
    metadata: str = Field("metadata", min_length=1, max_length=MAX_NAME_CHARS)
    # Preference files (algorithm: dpo): the preferred and the dispreferred response.
    chosen: str = Field("chosen", min_length=1, max_length=MAX_NAME_CHARS)
    rejected: str = Field("rejected", min_length=1, max_length=MAX_NAME_CHARS)
    # A JSON object of per-row arguments for the environment (`Episode.env_args`).
    env_args: str = Field("env_args", min_length=1, max_length=MAX_NAME_CHARS)


# data.task values that read train_path/val_path instead of generating examples.
FILE_TASKS = ("jsonl", "parquet")


class DataCfg(Section):
    # A synthetic task (addition, multiplication, countdown, reverse, sort, guess_number,
    # tool_multiplication, or an enabled plug-in's: `rlserve.catalog`), or "jsonl"/"parquet" for
    # train_path/val_path files.
    task: str = "addition"
    task_args: dict[str, Any] = {}
    # Data files, inside the cluster's data directories (the cluster file's `data_dirs`).
    train_path: str | None = Field(None, max_length=MAX_PATH_CHARS)
    val_path: str | None = Field(None, max_length=MAX_PATH_CHARS)
    # Which columns of the files hold the prompt (or chat messages), the answer and metadata.
    columns: DataColumnsCfg = DataColumnsCfg()
    # "raw": prompt text as the tokenizer encodes it; "chat": the tokenizer's chat template with
    # add_generation_prompt (rows with `messages` need it).
    prompt_format: Literal["raw", "chat"] = "raw"
    # A system message put before each prompt (chat format, rows without `messages`).
    system_prompt: str | None = Field(None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    num_train: int = Field(20000, ge=1, le=MAX_EXAMPLES)
    num_val: int = Field(128, ge=1, le=MAX_VAL_EXAMPLES)
    seed: Seed = 1234

    @field_validator("task")
    @classmethod
    def _task_known(cls, v: str) -> str:
        valid = [*TASKS.names, *FILE_TASKS]
        if v not in valid:
            close = difflib.get_close_matches(v, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown task {v!r}{hint} (valid: {', '.join(valid)})")
        return v

    @field_validator("task_args")
    @classmethod
    def _task_args(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        task = info.data.get("task")
        if task in TASKS:
            TASKS.load(task).parse_args(v)
        elif task in FILE_TASKS and v:
            raise ValueError(f"the {task} task takes no task_args")
        return v

    @model_validator(mode="after")
    def _paths(self) -> DataCfg:
        if self.task in FILE_TASKS and not self.train_path:
            raise ValueError(f"data.train_path: required when data.task is {self.task!r}")
        if self.task not in FILE_TASKS and (self.train_path or self.val_path):
            key = "train_path" if self.train_path else "val_path"
            raise ValueError(f"data.{key}: the {self.task!r} task generates its examples and reads no file; set "
                             f"data.task to {' or '.join(FILE_TASKS)} to train on files")
        if self.task not in FILE_TASKS and self.columns != DataColumnsCfg():
            raise ValueError(f"data.columns: only for data files (data.task: {' or '.join(FILE_TASKS)})")
        if self.system_prompt is not None and self.prompt_format != "chat":
            raise ValueError("data.system_prompt: needs data.prompt_format: chat")
        return self


def _host_port(v: str | None) -> str | None:
    if v is None:
        return v
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port, got {v!r}")
    return v


class RewardCfg(Section):
    # Empty: the functions the reward service was deployed with.
    functions: list[RewardFunctionCfg] = Field([], max_length=16)
    # host:port of an external gRPC server implementing rlserve.v1.Reward (one the cluster file's
    # reward.allowed_endpoints admits).
    endpoint: str | None = Field(None, max_length=300)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return _host_port(v)


class EnvCfg(Section):
    """A multi-turn environment (`rlserve.environments`), served by the reward application or by an
    external gRPC server implementing rlserve.v1.Environment. Off: each completion is scored once by
    `reward.functions`, as before."""

    enabled: bool = False
    # A name of `rlserve.catalog.ENVIRONMENTS` (single_turn: the reward functions as an environment done
    # after one step, scoring with reward.functions unless args.functions names others; guess_number;
    # tool_use; an enabled plug-in's), or `external_agent` (an agent program plays the episodes through
    # the OpenAI-compatible endpoint: `rlserve.agents`), or any label when import_path is given.
    name: str = Field("single_turn", min_length=1, max_length=MAX_NAME_CHARS)
    # "package.module:Class" or "/path/file.py:Class" of an `Environment` subclass; only plug-ins
    # the cluster file's reward.allowed_plugins lists.
    import_path: str | None = Field(None, max_length=MAX_PATH_CHARS)
    # Keyword arguments of the environment's constructor (per-row arguments come from the data's
    # env_args column); for external_agent: tool_format, declare_tools, tasks (`rlserve.agents.config`).
    args: dict[str, Any] = {}
    # host:port of an external gRPC server implementing rlserve.v1.Environment (one the cluster
    # file's reward.allowed_endpoints admits); unset: the reward application.
    endpoint: str | None = Field(None, max_length=300)
    # One Reset or Step call may take this long; an episode whose call takes longer is dropped
    # (its group, counted as env_error) and the run goes on. An external agent's episode must end
    # this long after it was handed out (else its group is dropped as episode_abandoned).
    timeout_s: float = Field(30.0, gt=0, le=3600)
    # Episodes in progress at once (each waits on its own generate and environment calls, so the
    # engine keeps generating for the others while one waits on its environment); an external_agent
    # run hands out at most this many unfinished episodes.
    max_concurrent_episodes: int = Field(256, ge=1, le=MAX_TRAJECTORIES_PER_STEP)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return _host_port(v)

    @property
    def external_agent(self) -> bool:
        """Episodes played by an agent program through the endpoint (`rlserve.agents`), not an environment."""
        return self.enabled and self.name == EXTERNAL_AGENT and self.import_path is None

    @model_validator(mode="after")
    def _known(self) -> EnvCfg:
        if self.name == EXTERNAL_AGENT and self.import_path is None:
            if self.endpoint is not None:
                raise ValueError("env.endpoint: an external_agent run's agents come to the endpoint; it names "
                                 "no environment server")
            try:
                ExternalAgentArgs.parse(self.args)
            except ValueError as err:
                raise ValueError(f"env.args.{err}") from None
            return self
        if self.import_path is None and self.name not in ENVIRONMENTS and self.endpoint is None:
            close = difflib.get_close_matches(self.name, ENVIRONMENTS.names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"env.name: unknown environment {self.name!r}{hint} (valid: "
                             f"{', '.join(ENVIRONMENTS.names)}, {EXTERNAL_AGENT}; or give env.import_path)")
        try:
            EnvironmentCfg(name=self.name, import_path=self.import_path, args=self.args)
        except ValueError as err:
            raise ValueError(f"env.args: {err}") from None
        return self

    def environment(self, reward_functions: list[RewardFunctionCfg]) -> EnvironmentCfg:
        """The environment the Reset and Step requests name; `single_turn` or `tool_use` without their own
        functions score with the run's reward.functions (none: the reward service's deployed ones)."""
        args = dict(self.args)
        if self.import_path is None and self.name in SCORED and "functions" not in args and reward_functions:
            args["functions"] = [f.model_dump(mode="json") for f in reward_functions]
        return EnvironmentCfg(name=self.name, import_path=self.import_path, args=args)


class CheckpointingCfg(Section):
    # Checkpoints live in the run directory (<runs_dir>/<run_id>/checkpoints), which the
    # cluster file places; a run cannot put them elsewhere.
    enabled: bool = True
    save_period: int = Field(10, ge=1, le=MAX_STEPS)
    keep_last: int = Field(2, ge=1, le=1000)
    # When a service loses the run's state (a learner worker dies, a replica restarts) or the
    # coordinator restarts under a running run, continue from the last checkpoint (or from the
    # start without one) instead of failing; a RECOVERED event says what was redone.
    auto_resume: bool = True
    # Recoveries allowed in a row without a new checkpoint in between (then the run fails).
    max_recovery_attempts: int = Field(3, ge=1, le=100)

    @model_validator(mode="before")
    @classmethod
    def _no_checkpoint_dir(cls, data: Any) -> Any:
        if isinstance(data, dict) and "checkpoint_dir" in data:
            raise ValueError("checkpointing.checkpoint_dir: not supported; checkpoints are kept in the run "
                             "directory (<runs_dir>/<run_id>/checkpoints), set `runs_dir` in the cluster file")
        return data


class LoggerCfg(Section):
    tensorboard_enabled: bool = True
    plot_enabled: bool = True


class ClusterCfg(Section):
    # Learner ranks (one torch.distributed process each).
    num_workers: int = Field(1, ge=1, le=MAX_WORKERS)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpus_per_worker: float = Field(0.5, gt=0, le=1024)
    gpus_per_worker: float = Field(0.0, ge=0, le=64)
    # Threads for torch inside each learner rank.
    torch_threads: int = Field(1, ge=1, le=1024)




class TeacherCfg(Section):
    """On-policy distillation's teacher (NeMo-RL's `teacher.model_name`): an HF folder or "preset:NAME"
    with the policy's tokenizer, possibly a larger model; the reference service scores the student's
    samples with it (`rlserve.algorithms.advantages.distillation`)."""

    model_name: str | None = Field(None, max_length=MAX_PATH_CHARS)
    model_seed: Seed = 0


class RunSpec(Section):
    # Part of the run id and of its folder's name.
    name: str = Field("grpo", min_length=1, max_length=MAX_NAME_CHARS, pattern=NAME_PATTERN)
    # What a run trains (`rlserve.catalog.ALGORITHMS`): grpo, on-policy distillation, or supervised
    # fine-tuning or DPO on a data file, each through the same loop, learner, checkpoints and run API.
    algorithm: str = "grpo"
    # The run's weight when it shares the cluster with other runs: of the rollout engines' tokens and
    # the learner's seconds, each run gets its priority over the sum of the priorities of the runs
    # wanting them (`rlserve.tenancy.fair_share`). Above 1 only as far as the user's quota
    # `max_priority` allows (`tenancy.default_user` / `tenancy.users.NAME` in the cluster file).
    priority: float = Field(1.0, gt=0, le=MAX_PRIORITY)
    policy: PolicyCfg = PolicyCfg()
    grpo: GrpoCfg = GrpoCfg()
    sft: SftCfg = SftCfg()
    dpo: DpoCfg = DpoCfg()
    loss_fn: LossFnCfg = LossFnCfg()
    data: DataCfg = DataCfg()
    reward: RewardCfg = RewardCfg()
    env: EnvCfg = EnvCfg()
    teacher: TeacherCfg = TeacherCfg()
    checkpointing: CheckpointingCfg = CheckpointingCfg()
    logger: LoggerCfg = LoggerCfg()
    cluster: ClusterCfg = ClusterCfg()

    @field_validator("algorithm")
    @classmethod
    def _algorithm_known(cls, v: str) -> str:
        return ALGORITHMS.check(v)

    @model_validator(mode="before")
    @classmethod
    def _distillation_estimator(cls, data: Any) -> Any:
        """`algorithm: distillation` trains with the on_policy_distillation estimator (its default); a spec
        that names that estimator in an `algorithm: grpo` run (how earlier specs asked for distillation)
        is a distillation run."""
        if not isinstance(data, dict) or not isinstance(data.get("grpo", {}), dict):
            return data
        grpo = data.get("grpo", {})
        estimator = grpo.get("adv_estimator", {})
        if not isinstance(estimator, dict):
            return data
        named = estimator.get("name")
        algorithm = data.get("algorithm", "grpo")
        if algorithm == "distillation" and named is None:
            return {**data, "grpo": {**grpo, "adv_estimator": {**estimator, "name": "on_policy_distillation"}}}
        if algorithm == "grpo" and named == "on_policy_distillation":
            return {**data, "algorithm": "distillation"}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RunSpec:
        gen = self.policy.generation
        if self.batch_size > MAX_TRAJECTORIES_PER_STEP:
            raise ValueError(
                f"grpo.num_generations_per_prompt: {self.grpo.num_prompts_per_step} prompts x "
                f"{self.grpo.num_generations_per_prompt} generations exceed {MAX_TRAJECTORIES_PER_STEP} "
                f"trajectories per step")
        if self.grpo.gen_batch_prompts * self.grpo.num_generations_per_prompt > MAX_TRAJECTORIES_PER_STEP:
            raise ValueError(
                f"grpo.batch_multiplier: generation batches of {self.grpo.gen_batch_prompts} prompts x "
                f"{self.grpo.num_generations_per_prompt} generations exceed {MAX_TRAJECTORIES_PER_STEP} trajectories")
        shaping = self.grpo.reward_shaping
        if shaping.enabled and shaping.overlong_buffer_length > self.max_response_length:
            raise ValueError(
                f"grpo.reward_shaping.overlong_buffer_length: {shaping.overlong_buffer_length} exceeds the "
                f"response length it ends at ({self.max_response_length}: grpo.reward_shaping.max_response_length "
                f"or policy.generation.max_new_tokens)")
        self._check_kl_in_reward()
        if self.loss_fn.mismatch_guard.action == "pause" and not self.checkpointing.enabled:
            raise ValueError("loss_fn.mismatch_guard.action: pause keeps the run resumable from a checkpoint; it "
                             "needs checkpointing.enabled")
        self._check_distillation()
        self._check_run_type()
        if gen.max_new_tokens >= self.policy.max_total_sequence_length:
            raise ValueError(
                f"policy.generation.max_new_tokens: {gen.max_new_tokens} must be below "
                f"policy.max_total_sequence_length ({self.policy.max_total_sequence_length})")
        if self.policy.sequence_packing.train_mb_tokens < self.policy.max_total_sequence_length:
            raise ValueError(
                f"policy.sequence_packing.train_mb_tokens: {self.policy.sequence_packing.train_mb_tokens} "
                f"must hold one sequence of policy.max_total_sequence_length "
                f"({self.policy.max_total_sequence_length})")
        if self.env.external_agent and ExternalAgentArgs.parse(self.env.args).tasks == "agent" and (
                self.grpo.val_period or self.grpo.val_at_start):
            raise ValueError("grpo.val_period: a run whose agents bring their own tasks (env.args.tasks: agent) "
                             "has no held-out tasks to hand out: set grpo.val_period: 0 and grpo.val_at_start: false")
        if self.grpo.max_rollout_turns > 1 and not self.env.enabled:
            raise ValueError(f"grpo.max_rollout_turns: {self.grpo.max_rollout_turns} turns need an environment "
                             f"that answers between them (env.enabled: true)")
        tp = self.policy.dtensor_cfg.tensor_parallel_size
        if self.policy.dtensor_cfg.enabled and self.cluster.num_workers % tp:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size: {tp} must divide cluster.num_workers "
                f"({self.cluster.num_workers})")
        return self

    def _check_kl_in_reward(self) -> None:
        if self.loss_fn.use_kl_in_reward and self.grpo.adv_estimator.name != "reinforce_plus_plus":
            raise ValueError(f"loss_fn.use_kl_in_reward: only the reinforce_plus_plus estimator puts the KL in "
                             f"the reward (grpo.adv_estimator.name is {self.grpo.adv_estimator.name!r})")

    def _check_distillation(self) -> None:
        distilling = self.algorithm == "distillation"
        estimator = self.grpo.adv_estimator.name
        if distilling != (estimator == "on_policy_distillation"):
            raise ValueError(f"grpo.adv_estimator.name: an algorithm: distillation run trains with "
                             f"on_policy_distillation, not {estimator!r}" if distilling else
                             f"grpo.adv_estimator.name: on_policy_distillation is the estimator of algorithm: "
                             f"distillation, not of an algorithm: {self.algorithm} run")
        if distilling != (self.teacher.model_name is not None):
            raise ValueError("teacher.model_name: required by algorithm: distillation" if distilling else
                             f"teacher.model_name: only read by on-policy distillation (algorithm: distillation; "
                             f"it is {self.algorithm!r})")
        if not distilling:
            return
        if self.loss_fn.reference_policy_kl_penalty > 0:
            raise ValueError("loss_fn.reference_policy_kl_penalty: in a distillation run the reference service "
                             "scores with the teacher, whose pull the advantages already carry; set it to 0")
        if self.grpo.use_dynamic_sampling:
            raise ValueError("grpo.use_dynamic_sampling: it drops groups whose rewards tie, which still carry the "
                             "teacher's signal in a distillation run")

    def _check_run_type(self) -> None:
        if ALGORITHMS[self.algorithm].samples_from_policy:
            return
        if self.sft.enabled:
            raise ValueError(f"sft.enabled: the SFT warm start comes before GRPO; an algorithm: {self.algorithm} run "
                             f"trains from policy.model_name itself" + (" with the sft section's settings"
                                                                        if self.algorithm == "sft" else ""))
        kwargs = self.policy.optimizer.kwargs
        if kwargs.lr != type(kwargs).model_fields["lr"].default:
            raise ValueError(f"policy.optimizer.kwargs.lr: an algorithm: {self.algorithm} run trains at "
                             f"{self.algorithm}.lr (policy.scheduler shapes it); set that instead")
        if self.policy.lora.enabled:
            raise ValueError(f"{self.policy.lora_key}.enabled: LoRA trains in RL runs only; an algorithm: "
                             f"{self.algorithm} run trains every weight")
        if self.algorithm == "dpo" and self.data.task not in FILE_TASKS:
            raise ValueError(f"data.task: an algorithm: dpo run trains on a preference file ({' or '.join(FILE_TASKS)} "
                             f"with prompt, chosen and rejected columns), not on the {self.data.task!r} task")
        packing = self.policy.sequence_packing
        if self.algorithm == "dpo" and packing.enabled and packing.train_mb_tokens < 2 * self.policy.max_total_sequence_length:
            raise ValueError(f"policy.sequence_packing.train_mb_tokens: {packing.train_mb_tokens} must hold a DPO pair, "
                             f"two sequences of policy.max_total_sequence_length "
                             f"({self.policy.max_total_sequence_length})")

    @property
    def max_num_steps(self) -> int:
        """The run's steps: its algorithm section's max_num_steps."""
        return getattr(self, ALGORITHMS[self.algorithm].section).max_num_steps

    @property
    def max_response_length(self) -> int:
        """Where DAPO's overlong penalty reaches its full weight."""
        return self.grpo.reward_shaping.max_response_length or self.policy.generation.max_new_tokens

    @property
    def batch_size(self) -> int:
        """Trajectories per GRPO step."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt

    @property
    def reference_to_learner(self) -> bool:
        """The loss's KL term needs reference logprobs, and the reference service computes them: a LoRA
        run's learner computes them itself with its adapters off (its reference is the base model)."""
        return (self.loss_fn.reference_policy_kl_penalty > 0 and not self.loss_fn.use_kl_in_reward
                and not self.policy.lora.enabled)

    @property
    def shares_deployed_base(self) -> bool:
        """An RL LoRA run that adapts the deployed model (no SFT warm start of its own base): its adapter is served
        beside other such runs' on the rollout's base, its learner session shares the frozen base with
        theirs, and the coordinator runs it at the same time as they (up to the cluster file's
        `tenancy.cluster.max_training_runs`)."""
        return ALGORITHMS[self.algorithm].samples_from_policy and self.policy.lora.enabled and not self.sft.enabled

    @property
    def reference_from_service(self) -> bool:
        """The coordinator asks the reference service for every step's logprobs: for the learner's KL term,
        for a KL in the reward (REINFORCE++), which the coordinator computes (in a LoRA run too, from
        the base model the run starts from), or for a distillation teacher's."""
        kl_in_reward = self.loss_fn.use_kl_in_reward and self.loss_fn.reference_policy_kl_penalty > 0
        return self.reference_to_learner or kl_in_reward or self.teacher.model_name is not None
