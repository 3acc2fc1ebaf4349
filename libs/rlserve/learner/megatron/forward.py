"""Model inputs for a micro-batch, and logprobs/entropy from vocab-parallel logits.

Padded micro-batches ([B, L], right padding) need no mask: under the causal
mask a real token never sees the padding after it, and padding positions are
never scored. Packed micro-batches ([1, T], several sequences back to back)
must not attend across sequences:

- local layer spec: an explicit block-diagonal causal mask [1, 1, T, T]
  (True = masked, Megatron's convention). Megatron's RoPE takes positions
  0..T-1 over the whole row, not the per-sequence `position_ids`; RoPE scores
  depend only on the distance between two positions, and the block-diagonal
  mask keeps every attended pair inside one sequence, so this equals per-sequence
  positions (up to rounding of cos/sin at larger angles).
- Transformer Engine spec: `PackedSeqParams` in the "thd" format with the
  sequences' cu_seqlens (the fused/flash kernels restrict attention per
  sequence and RoPE restarts per sequence), and no mask.

With sequence parallelism the sequence dim is split over TP, so rows are padded
to a multiple of the TP size. With pipeline parallelism every micro-batch of a
minibatch is padded to one shape [rows, width]: stages exchange activations of
the shape the schedule is given (Megatron's `variable_seq_lengths` would send
shapes first, but its config refuses that with the MoE allgather dispatcher).
Padding is never a completion token, and in a packed row it forms its own
segment.

Logprobs. With TP the output layer is vocab-parallel: each TP rank holds
logits for V/tp vocabulary entries. log p(target) is minus Megatron's
`vocab_parallel_cross_entropy` (a max and a sum-exp all-reduced over TP, the
target logit taken on the rank that owns it, its own backward), so the full
vocabulary is never gathered. The entropy (a metric, no gradient) uses the
same reductions: H = lse - sum_v p_v * l_v. Vocab rows that Megatron pads past
the HF vocabulary get logit -inf-like (the fp32 minimum) so they take no
probability mass, as in the HF model, which has no such rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlserve.training.batch import MicroBatch
from rlserve.training.forward import completion_positions


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_params: object | None
    # Rows of the flattened [B*L] logits that score a completion token, and those tokens, in row-major
    # order (that of MicroBatch's flat per-token vectors); built on the host, so selecting needs no sync.
    hidden_index: torch.Tensor
    targets: torch.Tensor

    def model_kwargs(self) -> dict:
        kwargs = dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=self.attention_mask)
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


def model_inputs(mb: MicroBatch, device: torch.device, rows: int, width: int, use_te: bool, pad_id: int
                 ) -> ModelInputs:
    """What GPTModel.forward takes for `mb` padded to [rows, width], on `device` (module docstring)."""
    packed = is_packed(mb)
    input_ids = _pad(mb.input_ids, rows, width, pad_id)
    completion = _pad(mb.completion_mask, rows, width, False)
    mask, packed_params = None, None
    if packed:
        extra = width - mb.position_ids.shape[1]
        position_ids = torch.cat([mb.position_ids, torch.arange(extra)[None]], dim=1) if extra else mb.position_ids
        starts = position_ids[0] == 0
        if use_te:
            packed_params = _packed_seq_params(starts, device)
        else:
            segment = torch.cumsum(starts.long(), 0)
            causal = torch.ones(width, width, dtype=torch.bool).tril_()
            allowed = causal & (segment[:, None] == segment[None, :])
            mask = (~allowed)[None, None].to(device)
    else:
        position_ids = torch.arange(width).expand(rows, width).contiguous()
    hidden_index = completion_positions(completion).flatten().nonzero().squeeze(1)
    return ModelInputs(input_ids.to(device), position_ids.to(device), mask, packed_params, hidden_index.to(device),
                       input_ids[completion].to(device))


def _packed_seq_params(starts: torch.Tensor, device: torch.device):
    from megatron.core.packed_seq_params import PackedSeqParams

    begin = torch.nonzero(starts).flatten()
    cu = torch.cat([begin, torch.tensor([starts.numel()])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                           max_seqlen_kv=max_len)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [N] (differentiable) and the entropy [N] (no grad) of vocab-parallel logits [N, V/tp]."""
    from megatron.core import parallel_state, tensor_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    rank, part = parallel_state.get_tensor_model_parallel_rank(), logits.shape[-1]
    logits = logits.float()
    first = rank * part
    if first + part > vocab_size:  # Megatron's padded vocab rows: no probability mass
        padded = torch.arange(first, first + part, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
    # Entropy first: vocab_parallel_cross_entropy overwrites its input in place (saving a copy of
    # the logits); `logits` here is already a temporary (the selected rows), never the model output.
    entropy = _vocab_parallel_entropy(logits, group) if with_entropy else None
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    return logprobs, entropy


@torch.no_grad()
def _vocab_parallel_entropy(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tp = dist.get_world_size(group)
    top = logits.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top[:, None]
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    if tp > 1:
        dist.all_reduce(sums, group=group)
    # H = log Z - E[l - max] with Z = sum exp(l - max).
    return sums[0].log() - sums[1] / sums[0]
