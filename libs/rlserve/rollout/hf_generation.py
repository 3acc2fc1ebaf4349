"""How the transformers engine generates (`EngineSettings.generation`), beside its plain `generate`.

    generate     transformers `generate` with a dynamic KV cache: every feature, one padded batch
    continuous   transformers' continuous batching (the engine behind `transformers serve`): a paged KV cache,
                 requests joining and leaving the running batch, a prompt prefilled once for its `n` samples
                 (forked after the prefill), CUDA graphs where transformers turns them on (flash attention).
                 Without flash attention (`sdpa`) a step attends over all its requests' tokens at once through
                 a block-diagonal mask: a decode step of R requests of L tokens costs R x R x L, not R x L
    static       `generate` with a static KV cache (prompt widths rounded up to 64); on a GPU transformers
                 compiles its decode step (torch.compile, mode reduce-overhead: CUDA graphs), which runs on
                 the process's one generation thread (`on_generation_thread`)
    compiled     rlserve's own decode loop over a static KV cache (`rlserve.rollout.hf_decode`): one step function
                 (forward, raw logprob, draw) compiled into CUDA graphs on a GPU, no per-step host work beyond the
                 graph replay; stop strings are cut after the loop
    auto         compiled on CUDA, generate on the CPU. On an H100 with the 1b preset and a GRPO step's batch (16
                 prompts x 8 samples x 512 tokens), on one machine: compiled 13.0k tokens/s, static 9.3k, generate
                 6.8k (BENCHMARKS.md, "rlserve's own decode loop on one H100"); earlier, continuous batching (sdpa:
                 no flash attention there) ran at 0.20x generate and transformers' own generate_batch at 0.51x
                 ("Generation paths on one H100"). On the CPU nothing is compiled and generate is as fast

Exactness. Every path reports what the engine always did: each sampled token's logprob under the model's own
temperature-1 distribution over the whole vocabulary (vLLM's raw logprobs, what the learner computes), whatever
temperature, top-k and top-p cut from the sampling distribution. `generate` and static take it from `generate`'s
raw logits. Continuous batching's own `return_logprobs` are the processed distribution's, so this module replaces
its model runner's step (`_raw_logprob_step`): the same forward pass, logits processors and draw as transformers
5.19's, but the logprob is taken from the raw logits.

Weights. A weight update copies into the parameters in place (`load_from_checkpoint`, the same-device handoff),
so the persistent manager, which holds the engine's model object, and any CUDA graph it captured (which reads the
parameters' storage) see the new weights, as does the static path's compiled step (parameters are its inputs,
not constants); a model that is replaced (a base reloaded) gets a new manager. The paged cache's prefix blocks
are forgotten before every call: no key/value computed by older weights is reused.

What the fast paths leave to `generate` (the engine logs why, once per reason): LoRA adapters (peft's layers
change the model's modules under a captured graph), MoE routing capture (its hooks record one padded batch),
min_new_tokens and top logprobs for continuous batching and the compiled loop, and stop strings for continuous
batching, whose samplers do not do them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from rlserve.rollout.interfaces import SamplingSpec

log = logging.getLogger("rlserve.rollout")
T = TypeVar("T")

GenerationMode = Literal["auto", "generate", "continuous", "static", "compiled"]

# The paged cache: pages of this many tokens (transformers' default), and at most this many tokens in one forward
# pass. Without flash attention, continuous batching builds an attention mask of [batch tokens, cache tokens]: a
# smaller batch keeps it small (2048 x 262k bf16 is 1.1 GB for the 1b preset at 256 x 1024 tokens).
PAGE_SIZE = 256
MAX_BATCH_TOKENS = 2048
# Prompt widths of the static cache are rounded up to this, so that torch.compile meets few shapes.
STATIC_WIDTH_MULTIPLE = 64


def resolve(mode: GenerationMode, device: torch.device) -> str:
    """The path `mode` means on `device`: auto is compiled on CUDA, generate elsewhere."""
    if mode == "auto":
        return "compiled" if device.type == "cuda" else "generate"
    return mode


def unsupported(path: str, sampling: SamplingSpec, lora: bool) -> str:
    """Why `path` cannot serve a request with `sampling` on this model ("" when it can)."""
    if path == "generate":
        return ""
    if lora:
        return "LoRA adapters are served"
    if sampling.routed_experts:
        return "MoE routing is recorded"
    if path == "compiled":
        if sampling.min_new_tokens:
            return "min_new_tokens is set"
        if sampling.top_logprobs:
            return "top logprobs are asked for"
    if path == "continuous":
        if sampling.stop_strings:
            return "stop strings are asked for"
        if sampling.min_new_tokens:
            return "min_new_tokens is set"
        if sampling.top_logprobs:
            return "top logprobs are asked for"
    return ""


def static_padded(input_ids: torch.Tensor, attention: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [rows, width] padded further on the left to a multiple of STATIC_WIDTH_MULTIPLE (masked
    out), so that the compiled decode step meets few cache lengths."""
    extra = -input_ids.shape[1] % STATIC_WIDTH_MULTIPLE
    return (nn.functional.pad(input_ids, (extra, 0), value=pad), nn.functional.pad(attention, (extra, 0), value=0))


# The one thread the compiled paths (static, compiled) run on, for every engine of the process. torch 2.11's
# CUDA graph trees keep their state in thread-locals of the thread that first imported them, and a compiled call
# from another thread fails a bare assertion (`get_obj` in torch/_inductor/cudagraph_trees.py; 2.13 sets the
# state up per thread): a second engine on a thread of its own did, the third engine of one process in
# scripts/bench/generation_gpu.py on an H100. The rollout replica calls the engine from a pool of threads; on one
# thread the graphs are also recorded once, in one memory pool.
_GENERATION_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-generate")


def on_generation_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the process's one compiled-generation thread; returns its result."""
    return _GENERATION_THREAD.submit(fn, *args).result()


def _raw_logprob_step(runner: Any) -> None:
    """Make `runner` (a continuous batching `ModelRunner`) report raw logprobs: its
    `_forward_process_and_sample`, as in transformers 5.19, with the sampled token's logprob taken from the model's
    logits before the logits processors (temperature, top-k, top-p; all three return new tensors, so the raw
    logits survive them). Set before any CUDA graph is captured or the step compiled."""

    def step(model: nn.Module, batch_data: dict, carry_over_ids: torch.Tensor, prev_output_ids: torch.Tensor,
             output_ids: torch.Tensor) -> None:
        runner.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
        logits = model(**batch_data).logits
        indices = batch_data["logits_indices"]
        if "logits_to_keep" not in batch_data:
            logits = logits[:, indices, :]
        logits = logits[0].float()  # [rows, vocab]
        scores = logits
        if runner.logit_processor.do_processing:
            scores = runner.logit_processor(batch_data["input_ids"][0, indices], logits,
                                            batch_data["logits_processor_args"])
        if runner.do_sample:
            tokens = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1)
        else:
            tokens = torch.argmax(scores, dim=-1, keepdim=True)
        logprobs = nn.functional.log_softmax(logits, dim=-1).gather(1, tokens).squeeze(-1)
        rows = tokens.size(0)
        output_ids[0, :rows].copy_(tokens.squeeze(-1))
        output_ids[1, :rows].copy_(logprobs.view(dtype=torch.int32))  # the float32 bits, as transformers stores them

    runner._forward_process_and_sample = step
    if runner._compiled_varlen is not None:
        runner._compiled_varlen = torch.compile(step, **runner.cb_config.varlen_compile_config.to_dict())
    if runner._compiled_decode is not None:
        runner._compiled_decode = torch.compile(step, **runner.cb_config.decode_compile_config.to_dict())


class ContinuousBatching:
    """One continuous batching manager over the engine's model, kept between calls (its paged cache, and CUDA
    graphs where transformers captures them) and started for each call's requests only, so nothing polls between
    calls. It is rebuilt when the model object or the sampling processors (greedy, temperature, top-k, top-p)
    change. The cache holds `max_sequences` sequences of `max_model_len` tokens."""

    def __init__(self, max_sequences: int, max_model_len: int, cuda_graphs: bool | None = None):
        self.max_sequences = max_sequences
        self.max_model_len = max_model_len
        self.cuda_graphs = cuda_graphs  # None: transformers decides (on with flash attention, off with a mask)
        self._manager: Any = None
        self._key: tuple | None = None

    def generate(self, model: nn.Module, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                 stop_ids: set[int]) -> list[tuple[list[int], list[float]]]:
        """`n` samples of each prompt, in prompt order (a prompt's `n` together): the sampled ids (the stop token
        included) and each one's raw logprob."""
        with torch.inference_mode(False), torch.no_grad():  # its tensors are the generation thread's (no inference mode)
            manager = self._manager_for(model, sampling)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)  # weights copied on another stream are in place before the step
        manager.batch_processor.cache.reset()  # forget prefix blocks: their keys/values may be older weights'
        manager.num_return_sequences = n  # each prompt prefilled once, then forked into n requests
        manager.switch_to_cb_friendly_attn(model, manager.continuous_batching_config.auto_switch_to_flash)
        manager.start()
        results: dict[str, Any] = {}
        try:
            ids = [manager.add_request(prompt, max_new_tokens=sampling.max_new_tokens, eos_token_id=sorted(stop_ids))
                   for prompt in prompts]
            if None in ids:
                raise RuntimeError("continuous batching refused a request (see transformers' warning)")
            while len(results) < len(prompts) * n:
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                elif out is None and not manager.is_running():
                    raise RuntimeError(f"continuous batching stopped: {manager.background_thread_status.fatal_error}")
        except BaseException:
            manager.stop(block=True, timeout=30, hard_stop=True)
            self.close()  # the next call starts from a new manager
            raise
        manager.stop(block=True, keep_for_next_session=True)
        samples = []
        for rid in ids:
            for sid in [*(f"{rid}__child#{i}" for i in range(n - 1)), rid]:
                out = results[sid]
                if out.error is not None:
                    raise RuntimeError(f"continuous batching failed a request: {out.error}")
                samples.append((list(out.generated_tokens), list(out.logprobs)))
        return samples

    def close(self) -> None:
        """Let the manager go, its cache and graphs with it."""
        if self._manager is not None:
            self._manager.destroy()
            if getattr(self._manager.model, "_cached_continuous_batching_manager", None) is self._manager:
                del self._manager.model._cached_continuous_batching_manager
            self._manager, self._key = None, None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _manager_for(self, model: nn.Module, sampling: SamplingSpec) -> Any:
        greedy = sampling.temperature == 0
        key = (id(model), greedy, None if greedy else (sampling.temperature, sampling.top_p, sampling.top_k))
        if self._manager is not None and key == self._key:
            return self._manager
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if self._manager is not None:
            log.info("rollout: continuous batching rebuilt for %s", "another model" if key[0] != self._key[0]
                     else "other sampling settings")
        self.close()
        t0 = time.perf_counter()
        config = GenerationConfig(do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                                  top_p=None if greedy else sampling.top_p,
                                  top_k=None if greedy else sampling.top_k or 0,
                                  max_new_tokens=sampling.max_new_tokens, eos_token_id=-1)
        pages = self.max_sequences * math.ceil(self.max_model_len / PAGE_SIZE)
        cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=pages, max_batch_tokens=MAX_BATCH_TOKENS,
                                      max_requests_per_batch=self.max_sequences, max_memory_percent=1.0,
                                      return_logprobs=True, use_cuda_graph=self.cuda_graphs)
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        # The runner exists once the batch processor does: give it the raw-logprob step before any graph capture.
        manager.batch_processor = manager._create_batch_processor()
        _raw_logprob_step(manager.batch_processor.model_runner)
        manager.warmup()  # captures the CUDA graphs when they are on; nothing otherwise
        self._manager, self._key = manager, key
        resolved = manager.continuous_batching_config
        log.info("rollout: continuous batching ready in %.1f s: %d pages of %d tokens, %d tokens a step, "
                 "CUDA graphs %s, attention %s", time.perf_counter() - t0, resolved.num_blocks, PAGE_SIZE,
                 resolved.max_batch_tokens, resolved.use_cuda_graph, model.config._attn_implementation)
        return manager
