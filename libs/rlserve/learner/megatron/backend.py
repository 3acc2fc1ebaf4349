"""The Megatron-Core learner backend: GPTModel with TP/PP/EP/SP/DP, Megatron's DDP, optimizer and schedules.

The step has the dtensor backend's semantics exactly (`rlserve.training.objective`
owns the plan, the losses, the normalisation and the metrics); only the
machinery differs:

- forward/backward go through `get_forward_backward_func()`, so pipeline
  parallelism runs Megatron's 1F1B schedule; the last stage returns its final
  hidden states (`forward.defer_output_layer`), and the loss function it is
  given projects the completion positions onto this rank's vocabulary rows in
  bounded memory (`forward.vocab_parallel_logprobs`) and calls
  `StepObjective.micro_batch_loss`. Packed micro-batches go in Megatron's
  "thd" format with per-sequence attention and no [T, T] mask.
- Gradient scaling. Each micro-batch loss is already divided by the global
  count of the optimizer minibatch, so the wanted gradient is the plain sum over
  micro-batches and data-parallel ranks. Megatron's schedule divides each
  returned loss by the number of micro-batches (and multiplies it by the CP
  size), and its DDP scales gradients by 1/(dp * cp) before summing them over
  dp * cp ranks (`calculate_per_token_loss=False`; with `average_in_collective`
  the average does the same). So the loss function returns
  loss * dp * num_microbatches, which leaves exactly the sum.
- Megatron's optimizer (`get_megatron_optimizer`: Adam with decoupled weight
  decay = AdamW, grad clipping by the global norm, fp32 main params in bf16,
  optionally the distributed optimizer) steps once per minibatch; weight decay
  applies to every parameter as in the dtensor backend (`config_overrides={}`).
- The lr follows `rlserve.training.schedule.lr_factor` with torch LambdaLR's
  semantics (`LrSchedule`), over the Megatron optimizer's param groups.
- LoRA (`policy.megatron_cfg.peft`): adapters on the local spec's linear layers
  (`rlserve.learner.megatron.lora`), added after the HF weights load and
  before DDP and the optimizer, which then hold the adapters only. The
  reference policy is the same forward with the adapters off; export streams
  the PEFT adapter (`weights.AdapterExporter`); checkpoints hold the adapters
  and their optimizer state.

Megatron-Core targets CUDA. On a CPU device the backend refuses to start unless
`torch.cuda.current_device()` works, which only the test shim in
`tests/support/megatron_cpu.py` makes true.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from rlserve.config.spec import RunSpec
from rlserve.learner import lora
from rlserve.learner.interfaces import BackendInfo, LearnerBackend
from rlserve.learner.megatron import checkpoint, routing
from rlserve.learner.megatron import lora as megatron_lora
from rlserve.learner.megatron.config import (
    Passthrough,
    ddp_config,
    optimizer_config,
    transformer_overrides,
    use_transformer_engine,
)
from rlserve.learner.megatron.forward import (
    ModelInputs,
    defer_output_layer,
    model_inputs,
    output_weight,
    padded_shape,
    vocab_parallel_logprobs,
)
from rlserve.learner.megatron.hf_map import padded_vocab_size
from rlserve.learner.megatron.parallel_dims import (
    MegatronLayout,
    ModelShape,
    choose_layout,
    device_memory_bytes,
    initialize,
)
from rlserve.learner.megatron.support import check_supported
from rlserve.learner.megatron.weights import AdapterExporter, Exporter, load_adapter, stage_shard
from rlserve.models.architecture import num_experts
from rlserve.training.batch import MicroBatch
from rlserve.training.objective import StepObjective
from rlserve.training.schedule import lr_factor
from rlserve.weights.specs import checkpoint_specs

log = logging.getLogger(__name__)


def require_cuda(device: torch.device) -> None:
    """Fail early, and clearly, where Megatron-Core's CUDA-only training stack cannot run."""
    if device.type == "cuda":
        return
    try:
        # What Megatron's DDP buffers, optimizers and schedules allocate on.
        torch.empty(0, device=torch.cuda.current_device())
    except (AssertionError, RuntimeError) as exc:
        raise RuntimeError(
            f"the megatron learner backend needs CUDA (Megatron-Core's DDP, optimizer and pipeline "
            f"schedules allocate on torch.cuda.current_device()), but the learner device is {device}; "
            f"use policy.dtensor_cfg (the default backend) on CPU") from exc


class LrSchedule:
    """torch's LambdaLR semantics over a Megatron optimizer: lr = base * factor(step), set at step().

    The param groups are looked up at every use: loading optimizer state replaces them.
    """

    def __init__(self, optimizer, base_lr: float, factor):
        self.optimizer, self.base_lr, self.factor = optimizer, base_lr, factor
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * self.factor(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        # Like LambdaLR: the current lr is the one the optimizer state brought back (it may be an override).
        self.last_epoch = int(state["last_epoch"])


class MegatronBackend(LearnerBackend):
    name = "megatron"

    def __init__(self, spec: RunSpec, model_path: Path, device: torch.device, init_adapter: Path | None = None):
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        from rlserve.learner.megatron.model import megatron_config_from_hf

        self.spec, self.model_path, self.device = spec, Path(model_path), device
        passthrough = Passthrough.from_cfg(spec.policy.megatron_cfg)  # ValueError before any collective
        require_cuda(device)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        check_supported(self.hf_config, spec.policy.max_total_sequence_length)  # before any collective
        self.num_parameters = sum(int(torch.Size(s.shape).numel()) for s in checkpoint_specs(self.model_path).values())
        self.use_te = use_transformer_engine(spec.policy.megatron_cfg)
        self.layout = self._choose_layout()
        if dist.get_rank() == 0:
            log.info("megatron layout: %s", self.layout.describe())
        initialize(self.layout, spec.grpo.seed)
        torch.manual_seed(spec.grpo.seed)
        self.dp_size, self.dp_rank = self.layout.dp, ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_last, self.pp_group = ps.is_pipeline_last_stage(), ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.pad_id = self.hf_config.pad_token_id or 0

        self.tconfig = megatron_config_from_hf(
            self.hf_config, max_sequence_length=spec.policy.max_total_sequence_length,
            **transformer_overrides(spec, self.layout, passthrough))
        self.gpt = self._build_model()
        self.lora_targets, self.adapter_config = self._add_adapters() if spec.policy.lora.enabled else ({}, None)
        if init_adapter is not None:
            load_adapter(self.gpt, lora.read_adapter_for(init_adapter, self.adapter_config), self.hf_config,
                         self.lora_targets)
        if device.type == "cuda":
            # As Megatron's own get_model does before DDP: the local spec's torch norms are built on the
            # CPU, and with LoRA nothing else moves them (frozen parameters stay out of DDP's buffers),
            # which failed on the H200 with "weight is on cpu" in the first RMSNorm.
            self.gpt.cuda(torch.cuda.current_device())
        self._build_training_stack(passthrough)
        self.exporter = (AdapterExporter(self.gpt, self.hf_config, self.lora_targets) if self.adapter_config else
                         Exporter(self.gpt, self.hf_config, self.use_te, self.tconfig.moe_grouped_gemm))
        # Sequence parallel splits the sequence over TP.
        self.pad_multiple = self.layout.tp if self.layout.sequence_parallel else 1
        self.same_shapes_across_dp = (self.layout.ep > 1 and bool(self.tconfig.num_moe_experts)
                                      and self.tconfig.moe_token_dispatcher_type == "allgather")
        self.replays = routing.router_replays(self.gpt) if spec.policy.routing_replay else []
        self._version = 0

    def _choose_layout(self) -> MegatronLayout:
        """The parallel layout (parallel.py's rule), refusing combinations Megatron's local spec cannot train."""
        spec, cfg = self.spec, self.spec.policy.megatron_cfg
        packing = spec.policy.sequence_packing
        tokens = packing.train_mb_tokens if packing.enabled else (
            spec.policy.train_micro_batch_size * spec.policy.max_total_sequence_length)
        devices = torch.cuda.device_count() if self.device.type == "cuda" else dist.get_world_size()
        layout = choose_layout(cfg, ModelShape.from_hf(self.hf_config, self.num_parameters), dist.get_world_size(),
                               device_memory_bytes(self.device), tokens, spec.policy.precision, devices)
        if num_experts(self.hf_config) and layout.tp > 1 and not layout.sequence_parallel:
            raise NotImplementedError(
                "an MoE model with tensor_model_parallel_size > 1 needs policy.megatron_cfg.sequence_parallel "
                "(megatron-core's MoE layer refuses to train TP without SP); spread experts with "
                "expert_model_parallel_size instead")
        if spec.policy.routing_replay and num_experts(self.hf_config):
            reason = routing.refusal(layout, cfg.activation_checkpointing)
            if reason:
                raise NotImplementedError(reason)
        if layout.sequence_parallel and not self.use_te:
            raise NotImplementedError(
                "policy.megatron_cfg.sequence_parallel needs the Transformer Engine layer spec: the local spec's "
                "norm in megatron-core 0.16.1 (WrappedTorchNorm) refuses sequence parallelism")
        return layout

    def _build_model(self):
        """This pipeline stage's GPTModel, holding this rank's (TP, EP) shard of the HF weights."""
        from megatron.core import parallel_state as ps

        from rlserve.learner.megatron.model import build_gpt_model, load_megatron_state

        vocab_rows = padded_vocab_size(self.hf_config.vocab_size, self.layout.tp)
        gpt = build_gpt_model(self.hf_config, self.tconfig, pre_process=ps.is_pipeline_first_stage(),
                              post_process=ps.is_pipeline_last_stage(), use_te=self.use_te, vocab_size=vocab_rows)
        ranks = dict(tp_size=self.layout.tp, tp=ps.get_tensor_model_parallel_rank(), ep_size=self.layout.ep,
                     ep=ps.get_expert_model_parallel_rank(), etp_size=self.layout.etp,
                     etp=ps.get_expert_tensor_parallel_rank())
        load_megatron_state(gpt, stage_shard(gpt, self.model_path, self.hf_config, ranks, vocab_rows, self.use_te,
                                             self.tconfig.moe_grouped_gemm))
        if gpt.post_process:
            defer_output_layer(gpt)
        return gpt

    def _add_adapters(self) -> tuple[dict[str, tuple[str, ...]], dict]:
        """LoRA on this stage's GPTModel (`rlserve.learner.megatron.lora`), before DDP and the optimizer collect
        what trains: the adapted layers (path -> target HF modules) and the adapter's PEFT config."""
        cfg = self.spec.policy.lora
        targets = megatron_lora.layer_targets(self.hf_config, cfg, self.spec.policy.lora_key)
        megatron_lora.inject(self.gpt, targets, cfg, self.spec.grpo.seed, self.hf_config)
        leaves = sorted(leaf for modules in targets.values() for leaf in modules)
        return targets, lora.adapter_config(cfg, leaves, str(self.model_path))

    def _build_training_stack(self, passthrough: Passthrough) -> None:
        """(bf16: Float16Module ->) DDP with contiguous grad buffers -> Megatron optimizer -> lr schedule."""
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        module, self.forward_kwargs = self.gpt, {}
        if self.tconfig.bf16:
            # As Megatron-LM does: cast every parameter to bf16 (the local spec's torch norms are created
            # in fp32 otherwise, and the distributed optimizer's checkpoint mapping assumes one dtype) and
            # keep the output (final hidden states) in bf16; the scored logits are fp32.
            module = Float16Module(self.tconfig, self.gpt)
            self.forward_kwargs = {"fp32_output": False}
        self.model = DistributedDataParallel(self.tconfig, ddp_config(self.spec, passthrough), module)
        self.tconfig.no_sync_func = self.model.no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        # config_overrides={}: weight decay on every parameter, as torch's AdamW in the dtensor backend.
        self.optimizer = get_megatron_optimizer(optimizer_config(self.spec, passthrough), [self.model],
                                                config_overrides={})
        sched = self.spec.policy.scheduler
        self.scheduler = LrSchedule(self.optimizer, self.spec.policy.optimizer.kwargs.lr,
                                    partial(lr_factor, cfg=sched, total_steps=self.spec.max_num_steps))

    # --- contract ------------------------------------------------------------

    def info(self) -> BackendInfo:
        impl = "transformer_engine" if self.use_te else "local"
        adapters = ""
        if self.adapter_config:
            trainable = sum(p.numel() for p in self.gpt.parameters() if p.requires_grad)
            adapters = (f"; LoRA r={self.adapter_config['r']} on {','.join(self.adapter_config['target_modules'])}, "
                        f"{trainable / 1e6:.2f}M trainable on this rank")
        return BackendInfo(self.name, self.layout.world_size, f"{self.layout.describe()}; {impl} layer spec{adapters}",
                           self.num_parameters, str(self.device))

    def _run_updates(self, objective: StepObjective) -> list[float]:
        self.model.train()
        prev = self._prev_logprobs(objective) if objective.needs_prev_logprobs else None
        grad_norms = []
        for k, plan in enumerate(objective.plans):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss_fn = partial(self._loss, objective, k, prev[k] if prev else None, len(plan))
            self._run(plan, loss_fn, forward_only=False)
            ok, norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("the Megatron optimizer skipped its step (inf/nan gradients)")
            grad_norms.append(float(norm if norm is not None else self.optimizer.get_grad_norm()))
        return grad_norms

    # --- the step's pieces -----------------------------------------------------

    def _run(self, plan: list[MicroBatch], loss_fn, forward_only: bool) -> list:
        """Megatron's forward/backward schedule over this rank's micro-batches of one minibatch."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = [padded_shape(mb, self.pad_multiple) for mb in plan]
        if self.same_shapes_across_dp:
            # The MoE allgather dispatcher gathers equal token counts from every EP rank, and EP
            # ranks hold different data-parallel shards: pad to the largest shape any rank has.
            common = torch.tensor(shapes, device=self.device)
            dist.all_reduce(common, op=dist.ReduceOp.MAX, group=self.dp_group)
            shapes = [tuple(s) for s in common.tolist()]
        if self.layout.pp > 1:  # stages exchange activations of one shape per schedule call
            shapes = [tuple(max(dim) for dim in zip(*shapes))] * len(plan)
        # Built as the schedule asks for them: one micro-batch's inputs at a time.
        inputs = ((j, mb.to(self.device), model_inputs(mb, self.device, *shape, self.pad_id))
                  for j, (mb, shape) in enumerate(zip(plan, shapes)))
        rows, width = shapes[0]  # the schedule uses it for pipeline p2p only, where all shapes are equal
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn, self.forward_kwargs, self.replays),
                data_iterator=inputs, model=[self.model], num_microbatches=len(plan), seq_length=width,
                micro_batch_size=rows, forward_only=forward_only)
        finally:
            routing.set_targets(self.replays, None)

    @staticmethod
    def _forward_step(loss_fn, kwargs, replays, data_iterator, model):
        j, mb, inputs = next(data_iterator)
        if replays:  # MoE routing replay: this micro-batch's recorded experts (`megatron/routing.py`)
            rows, width = inputs.input_ids.shape
            routing.set_targets(replays, None if mb.routed_experts is None else
                                [t.to(inputs.input_ids.device) for t in routing.targets(mb.routed_experts, rows, width)])
        return model(**inputs.model_kwargs(), **kwargs), partial(loss_fn, j, mb, inputs)

    def _logprobs(self, inputs: ModelInputs, hidden: torch.Tensor, with_entropy: bool):
        rows = hidden.flatten(0, 1).index_select(0, inputs.hidden_index)
        return vocab_parallel_logprobs(rows, output_weight(self.gpt), inputs.targets, self.hf_config.vocab_size,
                                       with_entropy)

    def _loss(self, objective: StepObjective, k: int, prev: list[torch.Tensor] | None, num_microbatches: int,
              j: int, mb: MicroBatch, inputs: ModelInputs, hidden: torch.Tensor):
        """Last pipeline stage: the shared objective's loss, scaled for Megatron's schedule and DDP."""
        curr, entropy = self._logprobs(inputs, hidden, with_entropy=True)
        value = objective.micro_batch_loss(k, mb, curr, None if prev is None else prev[j], entropy)
        # The schedule divides by num_microbatches and DDP averages over dp: undo both (module docstring).
        return value * (self.layout.dp * num_microbatches), {}

    def _prev_logprobs(self, objective: StepObjective) -> list[list[torch.Tensor | None]]:
        """Logprobs under the weights at the start of the step, for steps of several updates."""
        return objective.prev_logprobs(self._forward_logprobs)

    def _reference_logprobs(self, objective: StepObjective) -> list[list[torch.Tensor | None]]:
        with megatron_lora.adapters_off(self.gpt):
            return [self._forward_logprobs(plan) for plan in objective.plans]

    @torch.no_grad()
    def _forward_logprobs(self, plan: list[MicroBatch]) -> list[torch.Tensor | None]:
        """A minibatch's micro-batches' logprobs (forward only); None on stages before the last, which
        never compute a loss."""

        def collect(j, mb, inputs, hidden):
            lps, _ = self._logprobs(inputs, hidden, with_entropy=False)
            return lps.sum() * 0.0, {"logprobs": lps}

        out = self._run(plan, collect, forward_only=True)
        return [d["logprobs"] for d in out] if self.pp_last else [None] * len(plan)

    def _finalize(self, objective: StepObjective) -> dict[str, float]:
        """Metrics live on the last pipeline stage; every rank returns the same dict."""
        metrics = objective.finalize(self.dp_group) if self.pp_last else None
        if self.layout.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
            metrics = box[0]
        return metrics

    # --- weights and checkpoints -------------------------------------------------

    def export_weights(self, dtype: torch.dtype | None = None, on_device: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.exporter.stream(dtype, on_device)

    def _save_model_and_optimizer(self, path: Path) -> None:
        checkpoint.save(path, self.gpt, self.optimizer, trainable_only=self.adapter_config is not None)

    def _load_model_and_optimizer(self, path: Path) -> None:
        checkpoint.load(path, self.gpt, self.optimizer, trainable_only=self.adapter_config is not None)

    def _rng_state(self) -> dict:
        return {**super()._rng_state(), "tracker": checkpoint.tracker_state()}

    def _set_rng_state(self, state: dict) -> None:
        super()._set_rng_state(state)
        checkpoint.set_tracker_state(state["tracker"])
