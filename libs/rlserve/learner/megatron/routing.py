"""MoE routing replay on the Megatron backend (`rlserve.models.moe_routing` says what and why).

megatron-core carries the mechanism (`moe_enable_routing_replay`: a `RouterReplay` per router, whose
REPLAY_FORWARD action takes the top-k ids from a target tensor and the probabilities from the router's
own scores at them: softmax over the replayed experts' logits where the model renormalises its top-k,
Mixtral's and Qwen3-MoE's `norm_topk_prob`, else the full softmax's values); rlserve sets each
micro-batch's targets. Megatron's routers see a micro-batch's tokens sequence-major ([s, b] flattened,
after the embedding's transpose), so the recorded routes [b, s, layers, k] are transposed to match.
Positions nothing was recorded for (each sequence's last token, padding) must still name k experts:
they take experts 0..k-1, which changes no logprob, since no completion token's score reads the output
at those positions (the last token predicts nothing; padding is masked or its own packed segment).

Replay covers the layouts whose routers see the whole micro-batch: no pipeline stages (each stage
would need its own layers' targets), no sequence or context parallelism (a rank's router sees a shard
of the sequence), and no activation recomputation (its backward recompute would need Megatron's
REPLAY_BACKWARD order); the backend refuses the others naming the key.
"""

from __future__ import annotations

import torch


def refusal(layout, recompute: bool) -> str:
    """Why routing replay cannot run on this layout ("" if it can)."""
    if layout.pp > 1:
        return "policy.megatron_cfg.pipeline_model_parallel_size: routing replay needs one pipeline stage"
    if layout.sequence_parallel or layout.cp > 1:
        return ("policy.megatron_cfg.sequence_parallel: routing replay needs every rank's router to see the whole "
                "sequence (no sequence or context parallelism)")
    if recompute:
        return "policy.megatron_cfg.activation_checkpointing: routing replay does not replay recomputed layers"
    return ""


def router_replays(gpt) -> list:
    """This model's `RouterReplay`s, one per MoE layer, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.router_replay for m in gpt.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]


def targets(routes: torch.Tensor, rows: int, width: int) -> list[torch.Tensor]:
    """Per MoE layer, the expert ids [width * rows, k] (sequence-major) of routes [b, s, layers, k] padded to
    [rows, width]; unrecorded positions (-1) take experts 0..k-1 (module docstring)."""
    b, s, layers, k = routes.shape
    padded = routes.new_full((rows, width, layers, k), -1)
    padded[:b, :s] = routes
    fill = torch.arange(k, dtype=padded.dtype).expand_as(padded)
    padded = torch.where((padded >= 0).all(dim=-1, keepdim=True), padded, fill).long()
    seq_major = padded.transpose(0, 1).reshape(width * rows, layers, k)
    return [seq_major[:, layer].contiguous() for layer in range(layers)]


def set_targets(replays: list, per_layer: list[torch.Tensor] | None) -> None:
    """The next forward pass replays `per_layer` (None: routes itself)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if per_layer is not None and len(per_layer) != len(replays):
        raise ValueError(f"routing replay: routes for {len(per_layer)} MoE layers, the model has {len(replays)}")
    for i, replay in enumerate(replays):
        replay.clear_indices()
        if per_layer is None:
            replay.clear_router_replay_action()
        else:
            replay.set_target_indices(per_layer[i])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
