"""HF checkpoint -> this rank's Megatron shard, and Megatron shards -> HF-named full tensors.

Loading: `hf_to_megatron` cuts this rank's (TP, EP, ETP) shard out of the HF
tensors (read lazily from the safetensors files); the pipeline stage keeps its
own layers, renamed from global to stage-local layer indices (GPTModel numbers
`decoder.layers.i` from 0 on every stage; `layer_number` is the global one).

Export streams one Megatron parameter at a time, in model order (stage 0's
parameters, then stage 1's, ...):
1. the stage's TP (or, for experts, expert-TP) ranks all-gather the
   parameter's shards (those split along `tp_split_dim`);
2. an expert parameter is all-gathered over the EP group too (EP rank e holds
   global experts e*n..e*n+n-1 under the same local names);
3. a stage other than the first sends its gathered tensors to global rank 0
   (from the stage's rank that shares rank 0's TP/DP/EP coordinates);
4. rank 0 converts with `megatron_param_to_hf` and yields HF names.
Data-parallel replicas hold identical weights (the distributed optimizer
all-gathers updated params after each step), so DP needs no communication.
Every rank walks the same plan (built once, collectively) and yields the same
names; only rank 0's tensors are real.

A LoRA run's adapters (`rlserve.learner.megatron.lora`) go the same way
(`AdapterExporter`, PEFT-named), and come back from a PEFT folder through
`load_adapter`, with the weight's own row maps.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from rlserve.learner.megatron.hf_map import (
    hf_names,
    hf_rows,
    hf_to_megatron,
    hf_to_shard,
    megatron_param_to_hf,
    tp_split_dim,
)
from rlserve.learner.megatron.lora import LoraLinear, is_column
from rlserve.weights import adapter
from rlserve.weights.buckets import exported

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class LazySafetensors(Mapping):
    """The tensors of an HF folder's *.safetensors files, read on access."""

    def __init__(self, folder: Path):
        self._files = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    self._files[name] = path

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _layer_maps(model: torch.nn.Module) -> tuple[dict[int, int], dict[int, int]]:
    """(global -> local, local -> global) decoder layer indices of this pipeline stage."""
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    return {g: i for i, g in local_to_global.items()}, local_to_global


def _global_name(name: str, local_to_global: dict[int, int]) -> str:
    m = _LAYER.match(name)
    return f"decoder.layers.{local_to_global[int(m.group(1))]}.{name[m.end():]}" if m else name


def _rename(name: str, layers: dict[int, int]) -> str | None:
    m = _LAYER.match(name)
    if not m:
        return name
    index = layers.get(int(m.group(1)))
    return None if index is None else f"decoder.layers.{index}.{name[m.end():]}"


def stage_shard(model: torch.nn.Module, hf_dir: Path, hf_config, ranks: dict[str, int], vocab_rows: int,
                use_te: bool, moe_grouped_gemm: bool) -> dict[str, torch.Tensor]:
    """The state dict of this rank's GPTModel (stage-local names) from the HF checkpoint in `hf_dir`."""
    shard = hf_to_megatron(LazySafetensors(hf_dir), hf_config, ranks["tp_size"], ranks["tp"], ranks["ep_size"],
                           ranks["ep"], etp_size=ranks["etp_size"], etp_rank=ranks["etp"], vocab_size=vocab_rows,
                           use_te=use_te, moe_grouped_gemm=moe_grouped_gemm)
    global_to_local, _ = _layer_maps(model)
    wanted = {k for k in model.state_dict() if not k.endswith("._extra_state")}
    out = {}
    for name, tensor in shard.items():
        local = _rename(name, global_to_local)
        if local in wanted:
            out[local] = tensor
    if "output_layer.weight" in wanted and "output_layer.weight" not in out:
        # Tied embeddings on a last stage without the embedding: Megatron keeps a copy there.
        out["output_layer.weight"] = shard["embedding.word_embeddings.weight"]
    return out


@dataclass(frozen=True)
class _Entry:
    stage: int
    local_name: str
    global_name: str
    shape: tuple[int, ...]  # of one TP/ETP shard
    shards: int  # TP (ETP for experts) shards to gather; 1 for replicated parameters
    expert: bool


class Exporter:
    """Built collectively once per backend; `stream()` must then be exhausted by every rank."""

    def __init__(self, model: torch.nn.Module, hf_config, use_te: bool, moe_grouped_gemm: bool):
        from megatron.core import parallel_state as ps

        self.model, self.hf_config = model, hf_config
        self.use_te, self.moe_grouped_gemm = use_te, moe_grouped_gemm
        self.tp_group, self.etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        self.ep_group, self.pp_group = ps.get_expert_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.rank = dist.get_rank()
        _, local_to_global = _layer_maps(model)
        self.params = {name: p for name, p in model.named_parameters() if self._exports(name)}
        mine = []
        for name, param in self.params.items():
            global_name = _global_name(name, local_to_global)
            expert = not getattr(param, "allreduce", True)
            group = self.etp_group if expert else self.tp_group
            shards = dist.get_world_size(group) if self._split(global_name) else 1
            mine.append(_Entry(self.stage, name, global_name, tuple(param.shape), shards, expert))
        stages: list[list[_Entry]] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(stages, mine, group=self.pp_group)
        self.plan = [e for stage in stages for e in stage]
        # The rank of each stage that shares rank 0's TP/DP/EP coordinates: rank 0's pipeline peers.
        self.rank0_peers = dist.get_process_group_ranks(self.pp_group) if self._in_rank0_pipeline() else None

    def _exports(self, name: str) -> bool:
        # Tied: the copy of the embedding on the last stage is not exported (HF has no lm_head).
        return not (self.hf_config.tie_word_embeddings and name == "output_layer.weight")

    def _split(self, global_name: str) -> bool:
        """Whether the parameter is split over its TP (ETP) group, so its shards are gathered."""
        return tp_split_dim(global_name) is not None

    def _in_rank0_pipeline(self) -> bool:
        return 0 in dist.get_process_group_ranks(self.pp_group)

    def _gather(self, entry: _Entry) -> list[torch.Tensor]:
        """This stage's TP/ETP shards of `entry` in rank order, for each EP rank in turn for an expert parameter.

        Shards are kept apart, not concatenated: `megatron_param_to_hf` un-fuses them per shard
        (linear_fc1 holds [gate_t; up_t] on TP rank t).
        """
        local = self.params[entry.local_name].detach().contiguous()
        shards = [local]
        if entry.shards > 1:
            shards = [torch.empty_like(local) for _ in range(entry.shards)]
            dist.all_gather(shards, local, group=self.etp_group if entry.expert else self.tp_group)
        if entry.expert and self.ep_size > 1:
            mine = torch.stack(shards)
            every = [torch.empty_like(mine) for _ in range(self.ep_size)]
            dist.all_gather(every, mine, group=self.ep_group)
            shards = [t for e in every for t in e.unbind(0)]
        return shards

    def _to_rank0(self, entry: _Entry, shards: list[torch.Tensor] | None, count: int,
                  dtype: torch.dtype) -> list[torch.Tensor]:
        """Point-to-point from the entry's stage to global rank 0, inside rank 0's pipeline group."""
        if self.rank0_peers is None:
            return []
        src = self.rank0_peers[entry.stage]
        if self.rank == src:
            for t in shards:
                dist.send(t, dst=0)
            return []
        if self.rank == 0:
            out = [torch.empty(entry.shape, dtype=dtype, device=self._device()) for _ in range(count)]
            for t in out:
                dist.recv(t, src=src)
            return out
        return []

    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def _convert(self, entry: _Entry, shards: list[torch.Tensor], ep_rank: int) -> list[tuple[str, torch.Tensor]]:
        return megatron_param_to_hf(entry.global_name, shards, self.hf_config, ep_size=self.ep_size,
                                    ep_rank=ep_rank, use_te=self.use_te, moe_grouped_gemm=self.moe_grouped_gemm)

    @torch.no_grad()
    def stream(self, dtype: torch.dtype | None, on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # Every stage holds the model's one dtype; rank 0 receives other stages' shards in it.
        model_dtype = next(iter(self.params.values())).dtype
        for entry in self.plan:
            experts = self.ep_size if entry.expert and self.ep_size > 1 else 1
            shards = self._gather(entry) if entry.stage == self.stage else None
            if entry.stage != 0:
                shards = self._to_rank0(entry, shards, experts * entry.shards, model_dtype)
            if self.rank != 0:
                meta = [torch.empty(entry.shape, device="meta")] * entry.shards
                for e in range(experts):
                    for name, _ in self._convert(entry, meta, e if entry.expert else 0):
                        yield name, torch.empty(0)
                continue
            for e in range(experts):
                group = shards[e * entry.shards:(e + 1) * entry.shards]
                for name, tensor in self._convert(entry, group, e if entry.expert else 0):
                    yield name, exported(tensor, dtype, on_device)


def _peft_name(hf_weight: str, part: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight`, "A" -> its PEFT tensor name,
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{adapter.PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{part}.weight"


class AdapterExporter(Exporter):
    """A LoRA run's adapters in the PEFT layout (`rlserve.weights.adapter`), streamed like the weights.

    `targets` maps a layer path (`self_attention.linear_qkv`) to its target HF modules
    (`rlserve.learner.megatron.lora.layer_targets`). The part of an adapter laid out like its layer's
    weight (B of a column-parallel layer, A of a row-parallel one) is gathered over TP and un-fused
    exactly as the weight (`megatron_param_to_hf` with the layer's weight name); a column layer's
    stacked A is split into its modules' A_i.
    """

    def __init__(self, model: torch.nn.Module, hf_config, targets: dict[str, tuple[str, ...]]):
        self.targets = targets
        super().__init__(model, hf_config, use_te=False, moe_grouped_gemm=False)

    def _exports(self, name: str) -> bool:
        return name.endswith((".lora_A", ".lora_B"))

    def _split(self, global_name: str) -> bool:
        module, _, part = global_name.rpartition(".lora_")
        return (part == "B") == is_column(module)

    def _convert(self, entry: _Entry, shards: list[torch.Tensor], ep_rank: int) -> list[tuple[str, torch.Tensor]]:
        module, _, part = entry.global_name.rpartition(".lora_")
        weight = f"{module}.weight"
        names = _targeted(weight, self.hf_config, self.targets)
        if self._split(entry.global_name):
            pairs = [(n, t) for n, t in megatron_param_to_hf(weight, shards, self.hf_config) if n in names]
        elif part == "A":  # a column layer's stacked A_i; one copy each (safetensors refuses shared storage)
            pairs = [(n, a.clone()) for n, a in zip(names, shards[0].split(shards[0].shape[0] // len(names)))]
        else:
            pairs = [(names[0], shards[0])]
        return [(_peft_name(name, part), tensor) for name, tensor in pairs]


def _targeted(weight: str, hf_config, targets: dict[str, tuple[str, ...]]) -> list[str]:
    """The HF weight names of the target modules of the layer whose weight is `weight`, in fusion order."""
    path = weight.split(".", 3)[3].removesuffix(".weight")
    return [n for n in hf_names(weight, hf_config) if n.split(".")[-2] in targets[path]]


@torch.no_grad()
def load_adapter(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], hf_config,
                 targets: dict[str, tuple[str, ...]]) -> None:
    """PEFT-named full adapter tensors into this rank's adapter shards: `AdapterExporter`'s inverse
    (B of a column layer fused and split like its weight, zero on rows of modules that are not targets)."""
    from megatron.core import parallel_state as ps

    expected = {_peft_name(n, part) for i in range(hf_config.num_hidden_layers) for path in targets
                for n in _targeted(f"decoder.layers.{i}.{path}.weight", hf_config, targets) for part in "AB"}
    if expected != set(tensors):
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    _, local_to_global = _layer_maps(model)
    for local, layer in model.named_modules():
        if not isinstance(layer, LoraLinear):
            continue
        weight = f"{_global_name(local, local_to_global)}.weight"
        names = _targeted(weight, hf_config, targets)
        a = [tensors[_peft_name(n, "A")] for n in names]
        b = {n: tensors[_peft_name(n, "B")] for n in names}
        if layer.column:
            fused = [b[n] if n in b else torch.zeros(rows, layer.rank, dtype=a[0].dtype)
                     for n, rows in zip(hf_names(weight, hf_config), hf_rows(weight, hf_config))]
            layer.lora_A.copy_(torch.cat(a))
            layer.lora_B.copy_(hf_to_shard(weight, fused, hf_config, tp_size, tp_rank))
        else:
            layer.lora_A.copy_(hf_to_shard(weight, a, hf_config, tp_size, tp_rank))
            layer.lora_B.copy_(b[names[0]])
