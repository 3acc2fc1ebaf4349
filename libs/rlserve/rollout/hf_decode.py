"""rlserve's own decode loop over a static KV cache: the transformers engine's `compiled` generation path.

transformers' `generate` with a static cache (the `static` path) compiles the model's forward pass, but around
it each step still runs generate's Python: logits processors, stopping criteria that read the device every step,
and a copy of the step's whole [rows, vocab] logits kept for the logprobs (8.6 GB for the 1b preset's GRPO batch).
On an H100 that step took 11.5 ms where reading the weights and the cache takes about 2 ms.

Here one function is the step: the forward pass of the step's tokens, the sampled token's raw logprob (the model's
temperature-1 distribution over the whole vocabulary, what the learner computes) and the draw (temperature,
top-k, top-p; an exponential race, argmax(p / E) with E ~ Exp(1), which samples from p without a device sync).
On a GPU it is compiled (torch.compile, mode reduce-overhead: CUDA graphs), so a step is one graph replay and two
small copies into the output buffers; the host reads the device only every STOP_CHECK_EVERY steps, to end when
every row has stopped. The prefill runs eagerly. The cache is kept between calls of the same shape (reset, not
reallocated), so the graphs recorded for it are replayed. The engine gives a model on this path attention that
reads each key/value head once in a decode step (`grouped_decode_attention`).

Weights copied into the parameters in place reach the graphs (parameters are graph inputs at fixed addresses).
"""

from __future__ import annotations

import torch
from torch import nn

from rlserve.rollout.interfaces import SamplingSpec

# The host checks whether every row has stopped once per this many steps (each check waits for the device).
STOP_CHECK_EVERY = 16
# The cache's length is the prompt width plus max_new_tokens, rounded up to this: few shapes to compile.
CACHE_LENGTH_MULTIPLE = 64


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from fp32 `logits` [rows, vocab] cut by temperature, top-k and top-p as transformers'
    warpers cut them (temperature 0: greedy), and its raw logprob (before any cut)."""
    raw = logits.log_softmax(-1)
    if temperature == 0:
        tokens = logits.argmax(-1, keepdim=True)
    else:
        scores = logits / temperature
        if 0 < top_k < scores.shape[-1]:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p < 1.0:
            ordered, order = scores.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
            cut = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
            cut[:, -1] = False  # the most likely token stays
            scores = scores.masked_fill(cut.scatter(1, order, cut), float("-inf"))
        race = torch.empty_like(scores).exponential_(1)
        tokens = (scores.softmax(-1) / race).argmax(-1, keepdim=True)
    return tokens, raw.gather(-1, tokens)


class StaticDecode:
    """The loop and what it keeps between calls: the static cache of the last shape, and the compiled step.
    `compile_step`: compile the step (on a GPU; on the CPU torch.compile would only add compile time)."""

    def __init__(self, compile_step: bool):
        self._cache = None
        self._cache_key: tuple | None = None
        self._compiled = compile_step
        self._step = torch.compile(self._forward_and_draw, mode="reduce-overhead", dynamic=False) \
            if compile_step else self._forward_and_draw

    def _forward_and_draw(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                          temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=self._cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()
        return draw(logits, temperature, top_k, top_p)

    def _cache_for(self, model: nn.Module, rows: int, length: int):
        from transformers import StaticCache

        key = (id(model), rows, length)
        if self._cache_key != key:
            self._cache = None  # the old cache's memory first
            self._cache = StaticCache(config=model.config, max_cache_len=length)
            self._cache_key = key
        else:
            self._cache.reset()
        return self._cache

    @torch.inference_mode()
    def generate(self, model: nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, sampling: SamplingSpec,
                 stop_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts [rows, width] and their attention mask -> the sampled ids [rows, steps] and each one's
        raw logprob, on the CPU. A row's ids run past its first stop token (the caller cuts there); `steps` is
        max_new_tokens, or fewer when every row stopped earlier."""
        device = model.device
        rows, width = input_ids.shape
        new = sampling.max_new_tokens
        length = -(-(width + new) // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE
        self._cache_for(model, rows, length)
        mask = torch.ones(rows, length, dtype=torch.long, device=device)
        mask[:, :width] = attention.to(device)
        input_ids = input_ids.to(device)
        prompt_positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        cut = (sampling.temperature, sampling.top_k or 0, sampling.top_p)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # weights copied on another stream are in place before the step
        logits = model(input_ids=input_ids, position_ids=prompt_positions, attention_mask=mask,
                       past_key_values=self._cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        token, logprob = draw(logits, *cut)
        out_ids = torch.empty(rows, new, dtype=torch.long, device=device)
        out_logprobs = torch.empty(rows, new, dtype=torch.float32, device=device)
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        positions = prompt_positions[:, -1:] + 1
        steps = new
        for t in range(new):
            out_ids[:, t:t + 1] = token
            out_logprobs[:, t:t + 1] = logprob
            stopped |= torch.isin(token[:, 0], stops)
            if t + 1 == new or ((t + 1) % STOP_CHECK_EVERY == 0 and bool(stopped.all())):
                steps = t + 1
                break
            if self._compiled:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are copied out: replay over them
            token, logprob = (x.clone() for x in self._step(model, token, positions, mask, *cut))
            positions = positions + 1
        return out_ids[:, :steps].cpu(), out_logprobs[:, :steps].cpu()
