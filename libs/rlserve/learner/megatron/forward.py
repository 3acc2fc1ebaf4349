"""Model inputs for a micro-batch, and logprobs/entropy from the final hidden states.

Padded micro-batches ([B, L], right padding) need no mask: under the causal
mask a real token never sees the padding after it, and padding positions are
never scored. Packed micro-batches ([1, T], several sequences back to back)
must not attend across sequences; they go in Megatron's "thd" format,
`PackedSeqParams` with the sequences' cu_seqlens and no mask, on both layer
specs: Megatron then applies RoPE per sequence (positions restart), and the
attention keeps each sequence to itself: Transformer Engine's fused/flash
kernels, or on the local spec rlserve's core attention
(`model.sdpa_attention_class` -> `rlserve.training.attention`), with memory
linear in T (no [T, T] mask).

With sequence parallelism the sequence dim is split over TP, so rows are padded
to a multiple of the TP size. With pipeline parallelism every micro-batch of a
minibatch is padded to one shape [rows, width]: stages exchange activations of
the shape the schedule is given (Megatron's `variable_seq_lengths` would send
shapes first, but its config refuses that with the MoE allgather dispatcher).
Padding is never a completion token, and in a packed row it forms its own
segment.

Logprobs. GPTModel would project every position onto the vocabulary and keep
those [T, V/tp] logits for backward; `defer_output_layer` makes it return the
final hidden states instead (gathered over sequence-parallel ranks, and marked
for the TP all-reduce of their gradient, as the output layer does), and
`vocab_parallel_logprobs` projects only the completion positions, in chunks,
with `rlserve.training.forward.gather_logprobs` (bounded memory in forward and
backward). With TP the output layer is vocab-parallel: each TP rank holds V/tp
vocabulary rows; the log-normaliser, target logit and entropy are combined
over TP with two small all-reduces, so the full vocabulary is never gathered.
Vocab rows that Megatron pads past the HF vocabulary take no probability mass,
as in the HF model, which has no such rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlserve.training.batch import MicroBatch
from rlserve.training.forward import completion_positions, gather_logprobs


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object | None
    # Rows of the flattened [B*L] hidden states that score a completion token, and those tokens, in row-major
    # order (that of MicroBatch's flat per-token vectors); built on the host, so selecting needs no sync.
    hidden_index: torch.Tensor
    targets: torch.Tensor

    def model_kwargs(self) -> dict:
        kwargs = dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None)
        if self.packed_seq_params is not None:
            kwargs["packed_seq_params"] = self.packed_seq_params
        return kwargs


def _pad(t: torch.Tensor, rows: int, width: int, value: int | bool) -> torch.Tensor:
    if t.shape == (rows, width):
        return t
    out = t.new_full((rows, width), value)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def padded_shape(mb: MicroBatch, multiple: int) -> tuple[int, int]:
    """(rows, width) of `mb` with the width rounded up to a multiple of `multiple`."""
    rows, width = mb.input_ids.shape
    return rows, -(-width // multiple) * multiple


def is_packed(mb: MicroBatch) -> bool:
    """Several sequences in one row (positions restart inside it)."""
    return mb.attention_mask is None and mb.input_ids.shape[0] == 1 and bool((mb.position_ids[0, 1:] == 0).any())


def model_inputs(mb: MicroBatch, device: torch.device, rows: int, width: int, pad_id: int) -> ModelInputs:
    """What GPTModel.forward takes for `mb` padded to [rows, width], on `device` (module docstring)."""
    packed = is_packed(mb)
    input_ids = _pad(mb.input_ids, rows, width, pad_id)
    completion = _pad(mb.completion_mask, rows, width, False)
    packed_params = None
    if packed:
        extra = width - mb.position_ids.shape[1]
        position_ids = torch.cat([mb.position_ids, torch.arange(extra)[None]], dim=1) if extra else mb.position_ids
        packed_params = _packed_seq_params(position_ids[0] == 0, device)
    else:
        position_ids = torch.arange(width).expand(rows, width).contiguous()
    hidden_index = completion_positions(completion).flatten().nonzero().squeeze(1)
    return ModelInputs(input_ids.to(device), position_ids.to(device), packed_params, hidden_index.to(device),
                       input_ids[completion].to(device))


def _packed_seq_params(starts: torch.Tensor, device: torch.device):
    from megatron.core.packed_seq_params import PackedSeqParams

    begin = torch.nonzero(starts).flatten()
    cu = torch.cat([begin, torch.tensor([starts.numel()])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                           max_seqlen_kv=max_len)


def defer_output_layer(gpt) -> None:
    """Make `gpt` (a last pipeline stage) return its final hidden states [b, s, h] instead of logits.

    The output layer keeps its weight (checkpoints, DDP buckets and the optimizer see no change);
    only its forward is replaced, by one that prepares the hidden states as ColumnParallelLinear
    prepares its input: gathered from sequence-parallel ranks (reduce-scattered gradient), or
    copied into the TP region (all-reduced gradient). `vocab_parallel_logprobs` then projects the
    scored rows with `output_weight(gpt)`.
    """
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = gpt.output_layer

    def hidden_states(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        elif dist.get_world_size(layer.tp_group) > 1:
            input_ = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
        # GPTModel transposes the output to [b, s, h], so its gradient comes back as a transposed
        # view; megatron-core 0.16.1's TP all-reduce (`mappings._reduce`) reduces `.contiguous()`
        # of its input and returns the input, which drops the reduction for such a view.
        return _ContiguousGrad.apply(input_), None

    layer.forward = hidden_states


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def output_weight(gpt) -> torch.Tensor:
    """This TP rank's rows of the output projection (the embedding when they are tied)."""
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [N] (differentiable) and the entropy [N] (no grad) of rows `hidden` [N, h]
    under this TP rank's vocabulary rows `weight` [V/tp, h] (module docstring)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    first = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    valid = max(0, min(weight.shape[0], vocab_size - first))  # Megatron's padded vocab rows: no mass
    return gather_logprobs(hidden, weight, targets, with_entropy=with_entropy, vocab_start=first, valid_rows=valid,
                           group=group if dist.get_world_size(group) > 1 else None)
