"""The run spec's `policy` section: the model, its optimizer and schedule, the learner backend that trains
it (with its LoRA settings) and the generation settings the deployed rollout must match.

Defaults live here, on the classes; `spec.py` holds the run spec that puts the sections together.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from rlserve.catalog import DEFAULT_BACKEND, LEARNER_BACKENDS, ROLLOUT_ENGINES
from rlserve.config.section import (
    MAX_LORA_RANK,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_SEED,
    MAX_SEQUENCE_LENGTH,
    MAX_STEPS,
    MAX_TRAJECTORIES_PER_STEP,
    MAX_WORKERS,
    Section,
)

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class AdamWKwargs(Section):
    lr: float = Field(1e-4, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, le=1.0)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class OptimizerCfg(Section):
    # The optimizer is AdamW (torch's, or Megatron's Adam with decoupled weight decay).
    kwargs: AdamWKwargs = AdamWKwargs()


class SchedulerCfg(Section):
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    # "constant" after warm-up, or cosine decay to min_lr_ratio * lr at grpo.max_num_steps.
    decay: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class LoraCfg(Section):
    """LoRA adapters (Hu et al. 2021, arXiv:2106.09685): the base model stays frozen, only low-rank
    updates B A of the targeted linear layers train, scaled by alpha / dim. NeMo-RL's keys, at its
    paths: `policy.dtensor_cfg.lora_cfg` and `policy.megatron_cfg.peft` (the enabled backend's
    section counts). With LoRA the reference policy is the base model with the adapters off."""

    enabled: bool = False
    # The rank r.
    dim: int = Field(16, ge=1, le=MAX_LORA_RANK)
    # The scale's numerator; unset: 2 x dim.
    alpha: float = Field(32.0, gt=0, le=1e6)
    dropout: float = Field(0.0, ge=0, lt=1)
    # The model's own module names (q_proj, ..., down_proj for Llama-shaped models); with
    # match_all_linear, every linear layer of attention and MLP (never embeddings or the head).
    target_modules: list[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]] = Field([], max_length=64)
    exclude_modules: list[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]] = Field([], max_length=64)
    match_all_linear: bool = True

    @model_validator(mode="before")
    @classmethod
    def _alpha_twice_dim(cls, data: Any) -> Any:
        if isinstance(data, dict) and "alpha" not in data:
            dim = data.get("dim", cls.model_fields["dim"].default)
            if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1:
                data = {**data, "alpha": 2.0 * dim}
        return data

    @model_validator(mode="after")
    def _targets(self) -> LoraCfg:
        if self.enabled and not self.match_all_linear and not self.target_modules:
            raise ValueError("target_modules: empty, and match_all_linear is off: no layer would be adapted")
        return self


class DTensorCfg(Section):
    enabled: bool = True
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_WORKERS)
    sequence_parallel: bool = False
    # Decoder layers keep only their input and recompute the rest in backward (less memory, one more forward).
    activation_checkpointing: bool = False
    # With activation_checkpointing: the share of decoder layers that do, spread evenly over the stack (0.25 of
    # 16: layers 3, 7, 11, 15); 1.0: every layer. A LoRA run's activations are most of its memory: checkpointing
    # a share of layers trades memory for a share of one forward's time.
    activation_checkpointing_fraction: float = Field(1.0, gt=0, le=1)
    cpu_offload: bool = False
    lora_cfg: LoraCfg = LoraCfg()

    # Where this backend's LoRA section lives (NeMo-RL's key).
    LORA_KEY: ClassVar[str] = "lora_cfg"


class MegatronCfg(Section):
    """Megatron-Core settings. Keys beyond these are forwarded to Megatron's
    TransformerConfig/DDP/optimizer configs and checked by the backend."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    enabled: bool = False
    tensor_model_parallel_size: int | None = Field(None, ge=1, le=MAX_WORKERS)
    pipeline_model_parallel_size: int | None = Field(None, ge=1, le=MAX_WORKERS)
    context_parallel_size: int | None = Field(None, ge=1, le=MAX_WORKERS)
    expert_model_parallel_size: int | None = Field(None, ge=1, le=MAX_WORKERS)
    expert_tensor_parallel_size: int | None = Field(None, ge=1, le=MAX_WORKERS)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    use_distributed_optimizer: bool = True
    peft: LoraCfg = LoraCfg()
    # "auto": Transformer Engine spec when transformer_engine imports, else local.
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"

    LORA_KEY: ClassVar[str] = "peft"

    def passthrough(self) -> dict[str, Any]:
        """Keys the user gave that are not fields of this class (forwarded to Megatron)."""
        return dict(self.model_extra or {})


class VllmCfg(Section):
    """The generation engine's settings. The engine is deployed with the cluster (the rollout
    service's `args` in the cluster file), not per run: a value left unset here is filled in at
    SubmitRun with what is deployed (the run directory's spec.yaml shows it), and a value that
    differs from what is deployed is refused (FAILED_PRECONDITION naming both)."""

    tensor_parallel_size: int | None = Field(None, ge=1, le=MAX_WORKERS)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=8, le=MAX_SEQUENCE_LENGTH)
    # Also the dtype the learner exports weights in.
    precision: Literal["float32", "bfloat16", "float16"] | None = None
    enforce_eager: bool | None = None


class GenerationCfg(Section):
    # The rollout engine (vllm, transformers, or an enabled plug-in's: `rlserve.catalog`); like vllm_cfg,
    # unset means "what is deployed", a different value is refused.
    backend: str | None = None
    # Engines may take less (vLLM: at most 2; a run asking more fails at its first generation).
    temperature: float = Field(1.0, ge=0, le=100.0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=1_000_000)
    max_new_tokens: int = Field(16, ge=1, le=MAX_SEQUENCE_LENGTH)
    stop_strings: list[StopString] = Field([], max_length=16)
    stop_token_ids: list[TokenId] = Field([], max_length=256)
    vllm_cfg: VllmCfg = VllmCfg()

    @field_validator("backend")
    @classmethod
    def _known_engine(cls, v: str | None) -> str | None:
        return v if v is None else ROLLOUT_ENGINES.check(v)


class SequencePackingCfg(Section):
    enabled: bool = False
    # Token budget of one packed micro-batch.
    train_mb_tokens: int = Field(2048, ge=16, le=2**24)
    # rlserve.training.packing: "balanced" packs into as many bins as first-fit decreasing needs,
    # with tokens spread evenly (lower peak memory for the same number of micro-batches).
    algorithm: Literal["balanced", "first_fit_decreasing"] = "balanced"


class PolicyCfg(Section):
    # An HF folder, or "preset:NAME" (a generated model, see `rlserve make-model`).
    model_name: str = Field("preset:tiny", max_length=MAX_PATH_CHARS)
    model_seed: Seed = 0
    precision: Literal["float32", "bfloat16"] = "float32"
    # Sequences per optimizer update; None: the whole GRPO batch in one update. Steps whose
    # batch shrank (dropped groups) end with a smaller update.
    train_global_batch_size: int | None = Field(None, ge=1, le=MAX_TRAJECTORIES_PER_STEP)
    train_micro_batch_size: int = Field(64, ge=1, le=MAX_TRAJECTORIES_PER_STEP)
    max_total_sequence_length: int = Field(128, ge=8, le=MAX_SEQUENCE_LENGTH)
    max_grad_norm: float | None = Field(1.0, gt=0)
    refit_buffer_size_mb: int = Field(64, ge=1, le=65_536)
    optimizer: OptimizerCfg = OptimizerCfg()
    scheduler: SchedulerCfg = SchedulerCfg()
    dtensor_cfg: DTensorCfg = DTensorCfg()
    megatron_cfg: MegatronCfg = MegatronCfg()
    generation: GenerationCfg = GenerationCfg()
    sequence_packing: SequencePackingCfg = SequencePackingCfg()
    # MoE routing replay (R3: Ma et al. 2025, arXiv:2510.11370): the rollout records the experts each
    # token was routed to, and the learner's forward passes route every token to those experts (the
    # gating weights still from its own router), so both sides run the same experts. Mixtral- and
    # Qwen3-MoE-shaped models, on a rollout engine that records routing (`rlserve.models.moe_routing`).
    routing_replay: bool = False

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v: str) -> str:
        from rlserve.models.presets import PRESETS

        if v.startswith("preset:") and v.removeprefix("preset:") not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; valid: {', '.join('preset:' + p for p in PRESETS)}")
        if not v:
            raise ValueError("must name an HF folder or preset:NAME")
        return v

    @model_validator(mode="before")
    @classmethod
    def _another_backend_replaces_the_default(cls, data: Any) -> Any:
        """`megatron_cfg.enabled: true` alone switches backends: the default backend's section,
        unless it says `enabled` itself, is turned off."""
        if isinstance(data, dict):
            default = data.get(f"{DEFAULT_BACKEND}_cfg")
            others = [data.get(f"{name}_cfg") for name in LEARNER_BACKENDS.names if name != DEFAULT_BACKEND]
            if any(isinstance(c, dict) and c.get("enabled") is True for c in others) and (
                    default is None or isinstance(default, dict) and "enabled" not in default):
                data = {**data, f"{DEFAULT_BACKEND}_cfg": {**(default or {}), "enabled": False}}
        return data

    @model_validator(mode="after")
    def _one_backend(self) -> PolicyCfg:
        enabled = [name for name in LEARNER_BACKENDS.names if getattr(self, f"{name}_cfg").enabled]
        if len(enabled) > 1:
            raise ValueError(f"policy.{enabled[1]}_cfg.enabled: policy.{enabled[0]}_cfg.enabled is true as well; "
                             f"enable exactly one learner backend")
        if not enabled:
            raise ValueError(f"policy.{DEFAULT_BACKEND}_cfg.enabled: no learner backend is enabled; set "
                             f"{' or '.join(f'policy.{name}_cfg.enabled' for name in LEARNER_BACKENDS.names)}")
        return self

    @property
    def backend(self) -> str:
        """The learner backend's name: the one whose `<name>_cfg` section is enabled."""
        return next(name for name in LEARNER_BACKENDS.names if getattr(self, f"{name}_cfg").enabled)

    @property
    def lora_key(self) -> str:
        """The key path of the enabled backend's LoRA section (for messages)."""
        return f"policy.{self.backend}_cfg.{type(getattr(self, f'{self.backend}_cfg')).LORA_KEY}"

    @property
    def lora(self) -> LoraCfg:
        """The enabled backend's LoRA section."""
        section = getattr(self, f"{self.backend}_cfg")
        return getattr(section, type(section).LORA_KEY)

    @model_validator(mode="after")
    def _lora_in_the_enabled_backend(self) -> PolicyCfg:
        for name in LEARNER_BACKENDS.names:
            section = getattr(self, f"{name}_cfg")
            key = type(section).LORA_KEY
            if not section.enabled and getattr(section, key).enabled:
                raise ValueError(f"policy.{name}_cfg.{key}.enabled: LoRA is set for the {name} backend, but the "
                                 f"run trains with {self.backend}; set it in {self.lora_key}")
        return self
