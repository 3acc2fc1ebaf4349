"""MoE routing capture and replay on transformers' Mixtral and Qwen3-MoE (routing replay, R3).

A mixture-of-experts layer sends each token to the top-k experts of its router. Tiny numerical
differences between the rollout engine and the learner (kernels, batch shapes, dtypes) flip the
choice for near-tied tokens, and a token routed to other experts gets another logprob: the largest
share of MoE mismatch (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
and Inference Routers", arXiv:2510.11370). Replay removes it: the rollout records every token's
experts, and the learner's forward passes route each token to those experts, taking the gating
weights from its own router at them (renormalised as the model's router does), so gradients still
reach the router.

`capture(model)` records, per MoE layer and forward call, the expert ids [rows, k] each router chose
(rows: the call's flattened batch x positions). `replay(model, routes)` runs the model's forward with
routes [rows, layers, k] (-1: the router's own choice, for positions nothing was recorded for), in the
rows order of the hidden states the layers see (`MicroBatch.routed_experts`, flattened). The routers
are the models' own `*TopKRouter` modules (transformers 5), found by class; each mirrors the forward
of its class exactly, so replaying a router's own choices reproduces its output bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class _RouterKind:
    # The top-k weights are renormalised to sum to 1: always (Mixtral), or as the config's
    # `norm_topk_prob` says (Qwen3-MoE, read off the router).
    always_normalised: bool
    # The weights are cast back to the logits' dtype (Qwen3-MoE) or stay fp32 (Mixtral).
    cast_to_logits_dtype: bool


ROUTERS = {"MixtralTopKRouter": _RouterKind(True, False), "Qwen3MoeTopKRouter": _RouterKind(False, True)}


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


def experts_per_token(model: nn.Module) -> int:
    return routers(model)[0].top_k


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Yields calls[layer]: every forward call's expert ids [rows, k] (int16, on the CPU), in order."""
    found = routers(model)
    calls: list[list[Tensor]] = [[] for _ in found]
    handles = [r.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out[2].to("cpu", torch.int16)))
               for r, seen in zip(found, calls)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _replayed(router: nn.Module, kind: _RouterKind, target: Tensor):
    """The router's forward with its top-k ids taken from `target` [rows, k] where they are >= 0."""
    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        own_values, own = torch.topk(probs, router.top_k, dim=-1)
        if target.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} recorded expert ids for a router that sees "
                             f"{tuple(own.shape)} (rows x experts per token)")
        recorded = (target >= 0).all(dim=-1, keepdim=True)
        index = torch.where(recorded, target.to(own.device, torch.long), own)
        values = probs.gather(-1, index)
        if kind.always_normalised or router.norm_topk_prob:
            values = values / values.sum(dim=-1, keepdim=True)
        if kind.cast_to_logits_dtype:
            values = values.to(logits.dtype)
        return logits, values, index
    return forward


@contextlib.contextmanager
def replay(model: nn.Module, routes: Tensor | None) -> Iterator[None]:
    """Inside: every router of `model` routes row i of its input to routes[i, layer] (routes [rows, layers,
    k]; None: no replay). Forward and backward passes (activation recomputation) both replay."""
    if routes is None:
        yield
        return
    found = routers(model)
    if routes.shape[1] != len(found):
        raise ValueError(f"routing replay: routes for {routes.shape[1]} MoE layers, the model has {len(found)}")
    for layer, router in enumerate(found):
        router.forward = _replayed(router, ROUTERS[type(router).__name__], routes[:, layer])
    try:
        yield
    finally:
        for router in found:
            del router.forward  # the class's own forward again


def rows(routes: Tensor | None) -> Tensor | None:
    """A micro-batch's routes [B, L, layers, k] as the rows the MoE layers see ([B * L, layers, k])."""
    return None if routes is None else routes.flatten(0, 1)


def sample_routes(calls: list[list[Tensor]], row: int, prompt_start: int, prompt_len: int, rows: int,
                  num_tokens: int) -> Tensor:
    """One sample's routes [positions, layers, k] out of a generate call's capture: the prefill call
    (rows x width positions, this row's prompt at prompt_start.. of its row) then one call per decoding
    step (rows x 1), call j (from 1) feeding the sample's token j - 1; every position of prompt + sample
    but the last (`num_tokens` sampled tokens), which no forward pass routed."""
    per_layer = []
    for layer_calls in calls:
        prefill = layer_calls[0]
        width = prefill.shape[0] // rows
        prompt = prefill.view(rows, width, -1)[row, prompt_start:prompt_start + prompt_len]
        decoded = [step.view(rows, -1)[row] for step in layer_calls[1:num_tokens]]
        per_layer.append(torch.cat([prompt, torch.stack(decoded)]) if decoded else prompt)
    return torch.stack(per_layer, dim=1)


def encode(routes: Tensor) -> tuple[int, int, bytes]:
    """(layers, k, int16 little-endian bytes) of routes [positions, layers, k], for `Sample.routed_experts`."""
    return routes.shape[1], routes.shape[2], routes.to(torch.int16).numpy().astype("<i2").tobytes()


def decode(num_layers: int, experts_per_token: int, data: bytes) -> Tensor:
    """Routes [positions, layers, k] (int16) from `encode`'s form."""
    import numpy as np

    flat = torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16))
    return flat.view(-1, num_layers, experts_per_token)
