"""transformers as a rollout engine: `generate` with a KV cache, or a faster path of transformers' own.

It serves where vLLM is absent (the GPU test machine) and is the reference
that vLLM's numbers are compared with. Same contract as the vLLM engine.
`EngineSettings.generation` picks the path: `generate`, continuous batching
or a static compiled cache (`rlserve.rollout.hf_generation`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlserve.devices import resolve_device
from rlserve.dtypes import torch_dtype
from rlserve.models import generation, moe_routing
from rlserve.models.architecture import load_causal_lm
from rlserve.models.checkpoint_layout import load_from_checkpoint, to_checkpoint
from rlserve.rollout import grouped_decode_attention, hf_decode, hf_generation
from rlserve.rollout.interfaces import (
    BatchEngine,
    EngineConfig,
    EngineInfo,
    GeneratedSample,
    RunAdapter,
    SamplingSpec,
)
from rlserve.weights import adapter, handoff
from rlserve.weights.digest import weight_digests

log = logging.getLogger("rlserve.rollout")


class TransformersEngine(BatchEngine):
    name = "transformers"

    def __init__(self, cfg: EngineConfig):
        from transformers import AutoTokenizer

        if cfg.cpu_cores:
            raise ValueError("cpu_cores: the transformers engine runs inside the rollout replica; "
                             "pin the replica with services.rollout.cpu_cores instead")
        if cfg.in_flight_kv_cache != "recompute":
            raise ValueError("in_flight_kv_cache: the transformers engine applies updates between requests only")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.torch_threads or len(os.sched_getaffinity(0)))
        if cfg.weight_transfer == "ipc":  # on a GPU by CUDA IPC, on the CPU through shared memory
            self.transfer_backend = handoff.BACKEND
        self.generation = hf_generation.resolve(cfg.generation, self.device)
        self.model = self._load(cfg.model_path)
        self.routing_unavailable = "" if moe_routing.is_moe(self.model) else "the model has no MoE layers"
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.eos_ids = generation.eos_ids(self.model, self.tokenizer)
        self.pad_id = generation.pad_id(self.tokenizer, self.eos_ids)
        self._served_adapter: tuple[int, list[str]] | None = None  # (rank, targets) of the adapter layers added
        # The base model the weights are (adapters apply to it); None after a full-weight update.
        self._base: Path | None = Path(cfg.model_path).resolve()
        # Runs' adapters on the deployed base (`RunAdapter`): adapter id -> peft adapter name.
        self._run_adapters: dict[int, str] = {}
        self._continuous = (hf_generation.ContinuousBatching(cfg.max_num_seqs, cfg.max_model_len)
                            if self.generation == "continuous" else None)
        self._decode = (hf_decode.StaticDecode(compile_step=self.device.type == "cuda")
                        if self.generation == "compiled" else None)
        self._fallbacks_told: set[str] = set()
        log.info("rollout: the transformers engine generates with %s (generation: %s, on %s)", self.generation,
                 cfg.generation, self.device)

    def _load(self, path: str | Path) -> torch.nn.Module:
        """The model at `path` on the engine's device, for inference; on the compiled path with sdpa attention, the
        decode steps' attention reads each key/value head once (`grouped_decode_attention`)."""
        model = load_causal_lm(path, torch_dtype(self.cfg.dtype)).to(self.device).eval()
        if self.generation == "compiled" and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(grouped_decode_attention.register())
        return model

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                 adapter: RunAdapter | None = None) -> list[list[GeneratedSample]]:
        self._activate(self._run_adapter(adapter) if adapter else "default" if self._served_adapter else None)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        stop_ids = {*self.eos_ids, *sampling.stop_token_ids}
        path = self._path(sampling)
        if path == "continuous":
            samples = [self._cut(ids, lps, stop_ids, ()) for ids, lps in
                       self._continuous.generate(self.model, prompts, n, sampling, stop_ids)]
        elif path == "compiled":
            samples = self._decoded([ids for ids in prompts for _ in range(n)], sampling, stop_ids)
        else:
            samples = self._padded([ids for ids in prompts for _ in range(n)], sampling, stop_ids, path == "static")
        grouped = [samples[i * n:(i + 1) * n] for i in range(len(prompts))]
        if sampling.prompt_logprobs is not None:
            for i, prompt in enumerate(prompts):
                picked, top = self.prompt_logprobs(prompt, sampling.prompt_logprobs, adapter)
                grouped[i] = [replace(s, prompt_logprobs=tuple(picked),
                                      prompt_top_logprobs=tuple(tuple(row) for row in top) if top else None)
                              for s in grouped[i]]
        return grouped

    def _path(self, sampling: SamplingSpec) -> str:
        """The generation path for this request: the engine's, or generate where it cannot serve it (said once)."""
        if self.generation == "generate":
            return "generate"
        from peft.tuners.lora import LoraLayer

        lora = any(isinstance(m, LoraLayer) for m in self.model.modules())
        why = hf_generation.unsupported(self.generation, sampling, lora)
        if not why:
            return self.generation
        if why not in self._fallbacks_told:
            self._fallbacks_told.add(why)
            log.info("rollout: generation %s: %s, so generate serves such requests", self.generation, why)
        return "generate"

    def _decoded(self, rows: list[list[int]], sampling: SamplingSpec, stop_ids: set[int]) -> list[GeneratedSample]:
        """The rows through rlserve's own decode loop (`hf_decode`), on the thread its CUDA graphs belong to."""
        input_ids, attention = hf_generation.static_padded(*generation.left_padded(rows, self.pad_id), self.pad_id)
        ids, lps = hf_generation.on_generation_thread(self._decode.generate, self.model, input_ids, attention,
                                                      sampling, stop_ids)
        return [self._cut(ids[i].tolist(), lps[i].tolist(), stop_ids, sampling.stop_strings) for i in range(len(rows))]

    def _padded(self, rows: list[list[int]], sampling: SamplingSpec, stop_ids: set[int], static: bool
                ) -> list[GeneratedSample]:
        """`generate` over the rows left-padded into one batch (with `static`, a static KV cache)."""
        input_ids, attention = generation.left_padded(rows, self.pad_id)
        if static:
            input_ids, attention = hf_generation.static_padded(input_ids, attention, self.pad_id)
        width = input_ids.shape[1]
        greedy = sampling.temperature == 0
        with moe_routing.capture(self.model) if sampling.routed_experts else contextlib.nullcontext() as calls:
            if static:
                out = hf_generation.on_generation_thread(self._generate, input_ids, attention, greedy, sampling,
                                                         stop_ids, True)
            else:
                out = self._generate(input_ids, attention, greedy, sampling, stop_ids, False)
        new_ids = out.sequences[:, width:]
        # Raw (temperature-1) logits of each step, as vLLM reports its logprobs, gathered one step at a
        # time: stacking every step's [rows, vocab] and taking log_softmax of the stack made two more
        # rows x tokens x vocab fp32 copies on the device (17 GB for 128 x 512 tokens of a 32k vocabulary;
        # the H200's 1b benchmark saw the rollout replica reach 96 GiB). These are the full vocabulary's
        # logprobs whatever top-p and top-k cut (what the learner computes): not the truncated
        # distribution's, renormalised over the kept tokens.
        picked = torch.stack([step.float().log_softmax(-1).gather(-1, new_ids[:, t:t + 1]).squeeze(-1)
                              for t, step in enumerate(out.logits)], dim=1).cpu()
        new_tokens = new_ids.cpu()
        samples = [self._cut(new_tokens[i].tolist(), picked[i].tolist(), stop_ids, sampling.stop_strings)
                   for i in range(len(rows))]
        if calls is not None:
            samples = [replace(s, routed_experts=moe_routing.sample_routes(
                calls, i, width - len(rows[i]), len(rows[i]), len(rows), len(s.token_ids)))
                for i, s in enumerate(samples)]
        if sampling.top_logprobs:
            k = min(sampling.top_logprobs, out.logits[0].shape[-1])
            tops = [step.float().log_softmax(-1).topk(k, dim=-1) for step in out.logits]
            samples = [replace(s, top_logprobs=tuple(
                tuple(zip(tops[t].indices[i].tolist(), tops[t].values[i].tolist())) for t in range(len(s.token_ids))))
                for i, s in enumerate(samples)]
        return samples

    @torch.inference_mode()  # also when the static path calls it on its own thread
    def _generate(self, input_ids: torch.Tensor, attention: torch.Tensor, greedy: bool, sampling: SamplingSpec,
                  stop_ids: set[int], static: bool):
        return self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else (sampling.top_k or 0),
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens or None,
            eos_token_id=sorted(stop_ids),
            pad_token_id=self.pad_id,
            stop_strings=list(sampling.stop_strings) or None,
            tokenizer=self.tokenizer if sampling.stop_strings else None,
            output_logits=True,
            return_dict_in_generate=True,
            cache_implementation="static" if static else None,
        )

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int], topk: int, adapter: RunAdapter | None = None
                        ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """The logprob of every prompt token after the first under the served weights (with `adapter`, that
        run's), and with `topk` > 0 the `topk` most likely tokens at each of those positions."""
        self._activate(self._run_adapter(adapter) if adapter else "default" if self._served_adapter else None)
        ids = torch.tensor([prompt], device=self.device)
        logp = self.model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1).cpu().tolist()
        if topk <= 0:
            return picked, []
        values, indices = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        return picked, [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices.cpu(), values.cpu())]

    def _cut(self, ids: list[int], lps: list[float], stop_ids: set[int], stop_strings: tuple[str, ...]
             ) -> GeneratedSample:
        for k, tok in enumerate(ids):
            if tok in stop_ids:
                return GeneratedSample(ids[:k + 1], lps[:k + 1], "stop", self.tokenizer.decode(ids[:k], skip_special_tokens=True))
            if stop_strings:
                text = self.tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
                hit = [s for s in stop_strings if s in text]
                if hit:
                    return GeneratedSample(ids[:k + 1], lps[:k + 1], "stop", text[: text.index(hit[0])])
        return GeneratedSample(ids, lps, "length", self.tokenizer.decode(ids, skip_special_tokens=True))

    def _run_adapter(self, run_adapter: RunAdapter) -> str:
        """The peft adapter name of a run's adapter version, added from its folder when not held (on the
        deployed base, restored first when other weights serve)."""
        if not self.cfg.enable_lora:
            raise ValueError("this rollout serves without LoRA (enable_lora in its args)")
        deployed = Path(self.cfg.model_path).resolve()
        if self._base != deployed or self._served_adapter is not None:
            self._load_base(deployed)
        name = self._run_adapters.get(run_adapter.adapter_id)
        if name is None:
            name = f"run{run_adapter.adapter_id}"
            self._inject(run_adapter.folder, name)
            self._run_adapters[run_adapter.adapter_id] = name
        return name

    def _inject(self, folder: Path, name: str) -> dict:
        """peft's layers for adapter `name`, filled from the PEFT folder; returns its config."""
        from peft import LoraConfig, inject_adapter_in_model

        tensors, config = adapter.read_adapter(folder)
        inject_adapter_in_model(LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                                           target_modules=config["target_modules"], bias="none"),
                                self.model, adapter_name=name)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for saved, tensor in tensors.items():
                params[adapter.param_name(saved, name)].copy_(tensor)
        self.model.eval()
        return config

    def _activate(self, name: str | None) -> None:
        """Adapter `name` on in every LoRA layer that has it (the others pass through); None: the base alone."""
        from peft.tuners.lora import LoraLayer

        for m in self.model.modules():
            if isinstance(m, LoraLayer):
                m._disable_adapters = name is None or name not in m.lora_A
                if not m._disable_adapters:
                    m._active_adapter = [name]

    def use_deployed_base(self) -> None:
        deployed = Path(self.cfg.model_path).resolve()
        if self._base != deployed or self._served_adapter is not None:
            self._load_base(deployed)

    def drop_adapter(self, adapter_id: int) -> None:
        from peft.tuners.lora import LoraLayer

        name = self._run_adapters.pop(adapter_id, None)
        if name is not None:
            for m in self.model.modules():
                if isinstance(m, LoraLayer) and name in m.lora_A:
                    m.delete_adapter(name)

    def load_adapter(self, folder: Path, base: Path) -> None:
        """peft's LoRA layers, added at the first adapter and refilled by every later one."""
        from peft import LoraConfig, inject_adapter_in_model

        if not self.cfg.enable_lora:
            raise ValueError("this rollout serves without LoRA (enable_lora in its args)")
        tensors, config = adapter.read_adapter(folder)
        if self._base != base.resolve() or self._run_adapters:  # other weights or runs' adapters: the base first
            self._load_base(base)
        if self._served_adapter is None:
            inject_adapter_in_model(LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                                               target_modules=config["target_modules"], bias="none"), self.model)
            self._served_adapter = (config["r"], sorted(config["target_modules"]))
        elif self._served_adapter != (config["r"], sorted(config["target_modules"])):
            raise ValueError(f"an adapter of rank {config['r']} on {config['target_modules']}: this engine "
                             f"serves rank {self._served_adapter[0]} on {self._served_adapter[1]}")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[adapter.param_name(name)].copy_(tensor)
        self.model.eval()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._load_checkpoint_state(dict(named_tensors))

    def load_weights_from_path(self, path: Path) -> None:
        state = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(f))
        self._load_checkpoint_state(state)

    def _load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Checkpoint-named tensors into the live model (fused MoE experts and tied weights included); a
        model that carries adapters (an earlier LoRA run's) is rebuilt without them first."""
        if self._served_adapter is not None or self._run_adapters:
            self._load_base(self.cfg.model_path)
        load_from_checkpoint(self.model, state)
        self._base = None

    def _load_base(self, base: Path) -> None:
        """The model in `base` (the deployed one, or a run's starting point), without adapters."""
        if self._continuous is not None:
            self._continuous.close()  # it holds the model being replaced
        self.model = self._load(base)
        self._served_adapter, self._base, self._run_adapters = None, base.resolve(), {}

    @torch.no_grad()
    def weight_digests(self) -> dict[str, str]:
        if self._served_adapter is not None or self._run_adapters:
            raise NotImplementedError("this replica serves LoRA adapters: digests cover full weights only")
        return weight_digests((ckpt_name, part) for name, param in self.model.named_parameters()
                              for ckpt_name, part in to_checkpoint(self.model, name, param).items())

    def info(self) -> EngineInfo:
        return EngineInfo("transformers", str(self.cfg.model_path), self.cfg.max_model_len,
                          self.model.config.vocab_size, self.cfg.dtype, extra={"generation": self.generation})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
