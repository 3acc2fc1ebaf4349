"""The learner's batch: what the coordinator puts in the object store, and how a
rank cuts its share into padded or packed micro-batches.

A `TrainBatch` stores sequences back to back (flat tensors plus lengths), so
it pickles as a handful of tensors. Everything after a sequence's prompt is its
completion; the loss mask says which completion tokens the loss counts (a
multi-turn episode's own tokens, not the environment's observations and the
chat template's turn markers between them, which are context only). A `MicroBatch` is what one forward pass
eats; its completion tokens, gathered row-major, line up with the flat
per-token vectors the loss functions take.

For the rollout-training consistency metrics (`rlserve.algorithms.mismatch`) a batch may carry each
completion token's age (learner version minus the version that sampled it) and turn; for MoE routing
replay (`rlserve.models.moe_routing`), the experts the rollout routed every token to.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from rlserve.training.attention import cu_seqlens_of
from rlserve.training.forward import completion_positions
from rlserve.training.packing import get_packer


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [total_tokens] long, sequences back to back (prompt then completion)
    seq_lens: torch.Tensor  # [S] long
    prompt_lens: torch.Tensor  # [S] long
    advantages: torch.Tensor  # [S] float32 (zeros for SFT)
    gen_logprobs: torch.Tensor | None  # [total_completion_tokens] float32, or None (SFT)
    ref_logprobs: torch.Tensor | None  # [total_completion_tokens] float32, or None (no KL)
    # [total_completion_tokens] float32 when each token has its own advantage (REINFORCE++'s KL in
    # the reward); then `advantages` is unused. None: every token takes its sequence's advantage.
    token_advantages: torch.Tensor | None = None
    # [total_completion_tokens] bool: the tokens the loss counts (SFT on a conversation: the assistant's
    # turns, not the user's between them). None: every completion token.
    loss_mask: torch.Tensor | None = None
    # [total_completion_tokens] int32: weight versions between the learner at this step and the engine that
    # sampled the token (0: on-policy), and which turn of its episode it belongs to (1, 2, ...; 0 for
    # context). None: not recorded (the consistency metrics then have no age or turn split).
    token_ages: torch.Tensor | None = None
    token_turns: torch.Tensor | None = None
    # [total_tokens, layers, experts_per_token] int16: the experts the rollout routed each token to (MoE
    # routing replay), -1 where none was recorded (the learner routes those itself). None: no replay.
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_sequences(cls, token_ids: list[list[int]], prompt_lens: list[int], advantages: list[float] | None = None,
                       gen_logprobs: list[list[float]] | None = None,
                       ref_logprobs: list[list[float]] | None = None,
                       token_advantages: list[list[float]] | None = None,
                       loss_mask: list[list[bool]] | None = None,
                       token_ages: list[list[int]] | None = None,
                       token_turns: list[list[int]] | None = None,
                       routed_experts: list[torch.Tensor] | None = None) -> TrainBatch:
        if not token_ids:
            raise ValueError("empty batch")
        for i, (ids, p) in enumerate(zip(token_ids, prompt_lens)):
            if not 0 < p < len(ids):
                raise ValueError(f"sequences[{i}]: prompt_length {p} must be in 1..{len(ids) - 1}")
            for name, per_tok in (("generator_logprobs", gen_logprobs), ("reference_logprobs", ref_logprobs),
                                  ("token_advantages", token_advantages), ("loss_mask", loss_mask),
                                  ("token_ages", token_ages), ("token_turns", token_turns)):
                if per_tok is not None and len(per_tok[i]) != len(ids) - p:
                    raise ValueError(f"sequences[{i}].{name}: {len(per_tok[i])} values for "
                                     f"{len(ids) - p} completion tokens")
            if loss_mask is not None and not any(loss_mask[i]):
                raise ValueError(f"sequences[{i}].loss_mask: no completion token is trained")
            if routed_experts is not None and routed_experts[i].shape[0] != len(ids):
                raise ValueError(f"sequences[{i}].routed_experts: {routed_experts[i].shape[0]} rows for "
                                 f"{len(ids)} tokens")

        def flat(rows: list[list[float]] | None, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            return None if rows is None else torch.tensor([v for r in rows for v in r], dtype=dtype)

        return cls(
            tokens=torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long),
            seq_lens=torch.tensor([len(ids) for ids in token_ids], dtype=torch.long),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
            advantages=torch.tensor(advantages if advantages is not None else [0.0] * len(token_ids),
                                    dtype=torch.float32),
            gen_logprobs=flat(gen_logprobs),
            ref_logprobs=flat(ref_logprobs),
            token_advantages=flat(token_advantages),
            loss_mask=None if loss_mask is None else torch.tensor([v for r in loss_mask for v in r], dtype=torch.bool),
            token_ages=flat(token_ages, torch.int32),
            token_turns=flat(token_turns, torch.int32),
            routed_experts=None if routed_experts is None else torch.cat(routed_experts).to(torch.int16),
        )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def completion_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prompt_lens

    def num_completion_tokens(self, idx: list[int]) -> int:
        return int(self.completion_lens[idx].sum())

    def num_loss_tokens(self, idx: list[int]) -> int:
        """The tokens of sequences `idx` that the loss counts (`loss_mask`)."""
        if self.loss_mask is None:
            return self.num_completion_tokens(idx)
        return int(_per_token(self, self.loss_mask, idx).sum()) if idx else 0

    def _offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        seq_start = torch.cumsum(self.seq_lens, 0) - self.seq_lens
        comp_start = torch.cumsum(self.completion_lens, 0) - self.completion_lens
        return seq_start, comp_start

    def sequence(self, i: int) -> torch.Tensor:
        seq_start, _ = self._offsets()
        return self.tokens[seq_start[i]:seq_start[i] + self.seq_lens[i]]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] (padded) or [1, T] (packed)
    position_ids: torch.Tensor  # same shape; restarts at 0 for every sequence
    packed: bool  # several sequences per row (attention must stay within each)
    attention_mask: torch.Tensor | None  # [B, L] for padded rows; None when packed
    completion_mask: torch.Tensor  # [B, L] bool: token is a completion token
    # Rows of the flattened [B*L] hidden states that predict a completion token, and those tokens:
    # built on the host so the forward pass needs no device->host sync to select them.
    hidden_index: torch.Tensor
    targets: torch.Tensor
    # Flat per-token vectors, in the row-major order of completion_mask:
    advantages: torch.Tensor
    gen_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    seq_index: torch.Tensor  # which sequence of this micro-batch each token belongs to
    num_seqs: int
    loss_mask: torch.Tensor | None  # bool, the tokens the loss counts; None: all
    num_tokens: int  # all tokens, prompts included (for throughput)
    # Packed rows: int32 [n + 1] cumulative sequence lengths and the longest one, for attention
    # kernels that keep each sequence to itself (`rlserve.training.attention`); None when padded.
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    # Flat per completion token (as gen_logprobs): age and turn (`TrainBatch.token_ages`, `token_turns`).
    token_ages: torch.Tensor | None = None
    token_turns: torch.Tensor | None = None
    # [B, L, layers, k] (padded) or [1, T, layers, k] (packed), aligned with input_ids: the experts to
    # replay, -1 where the learner routes itself (padding, tokens without a recorded route).
    routed_experts: torch.Tensor | None = None

    def to(self, device: torch.device) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return replace(self, **{f.name: mv(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def attention_kwargs(self) -> dict:
        """Keyword arguments that carry the packing to a transformers model (the names of its
        flash-attention path, read by `rlserve.training.attention.hf_packed_attention`)."""
        if self.cu_seqlens is None:
            return {}
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}


def _per_token(batch: TrainBatch, field: torch.Tensor | None, idx: list[int]) -> torch.Tensor | None:
    if field is None:
        return None
    _, comp_start = batch._offsets()
    return torch.cat([field[comp_start[i]:comp_start[i] + batch.completion_lens[i]] for i in idx])


def _make(batch: TrainBatch, idx: list[int], packed: bool, pad_id: int, dummy: bool = False) -> MicroBatch:
    """One micro-batch of sequences `idx`. A dummy one has no completion tokens: it runs the
    forward/backward collectives of a rank that has no real work left, contributing nothing."""
    seqs = [batch.sequence(i) for i in idx]
    comp_lens = torch.zeros(len(idx), dtype=torch.long) if dummy else batch.completion_lens[idx]
    starts = [len(s) if dummy else int(batch.prompt_lens[i]) for s, i in zip(seqs, idx)]
    cu_seqlens, max_seqlen = None, 0
    if packed:
        cu_seqlens, max_seqlen = cu_seqlens_of([len(s) for s in seqs]), max(len(s) for s in seqs)
        input_ids = torch.cat(seqs)[None]
        position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        completion = torch.cat([torch.arange(len(s)) >= p for s, p in zip(seqs, starts)])[None]
        attention = None
        routes = None if batch.routed_experts is None else torch.cat([_routes(batch, i) for i in idx])[None]
    else:
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        completion = torch.zeros((len(seqs), width), dtype=torch.bool)
        for row, (s, p) in enumerate(zip(seqs, starts)):
            input_ids[row, :len(s)] = s
            attention[row, :len(s)] = 1
            completion[row, p:len(s)] = True
        position_ids = torch.arange(width).expand(len(seqs), width).contiguous()
        routes = None
        if batch.routed_experts is not None:
            routes = batch.routed_experts.new_full((len(seqs), width, *batch.routed_experts.shape[1:]), -1)
            for row, i in enumerate(idx):
                routes[row, :len(seqs[row])] = _routes(batch, i)
        if all(len(s) == width for s in seqs):
            attention = None  # no padding: plain causal attention (the fused kernels' fast path)
    real = [] if dummy else idx
    return MicroBatch(
        input_ids=input_ids, position_ids=position_ids, packed=packed, attention_mask=attention,
        completion_mask=completion,
        hidden_index=completion_positions(completion).flatten().nonzero().squeeze(1),
        targets=input_ids[completion],
        advantages=(batch.advantages[idx].repeat_interleave(comp_lens) if batch.token_advantages is None
                    else _per_token(batch, batch.token_advantages, real) if real else _empty(batch.token_advantages)),
        gen_logprobs=_per_token(batch, batch.gen_logprobs, real) if real else _empty(batch.gen_logprobs),
        ref_logprobs=_per_token(batch, batch.ref_logprobs, real) if real else _empty(batch.ref_logprobs),
        seq_index=torch.arange(len(idx)).repeat_interleave(comp_lens), num_seqs=len(real),
        loss_mask=_per_token(batch, batch.loss_mask, real) if real else _empty(batch.loss_mask),
        num_tokens=0 if dummy else int(batch.seq_lens[idx].sum()), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        token_ages=_per_token(batch, batch.token_ages, real) if real else _empty(batch.token_ages),
        token_turns=_per_token(batch, batch.token_turns, real) if real else _empty(batch.token_turns),
        routed_experts=routes)


def _routes(batch: TrainBatch, i: int) -> torch.Tensor:
    """Sequence i's rows of `routed_experts` [len, layers, k]."""
    seq_start, _ = batch._offsets()
    return batch.routed_experts[seq_start[i]:seq_start[i] + batch.seq_lens[i]]


def _empty(field: torch.Tensor | None) -> torch.Tensor | None:
    return None if field is None else field.new_zeros(0)


def _unit_len(batch: TrainBatch, unit: list[int]) -> int:
    return int(sum(int(batch.seq_lens[i]) for i in unit))


def _groups(batch: TrainBatch, units: list[list[int]], packed: bool, micro_batch_size: int, mb_tokens: int,
            algorithm: str) -> list[list[int]]:
    """Micro-batches (sequence indices) of whole units: bins of `mb_tokens`, or `micro_batch_size` sequences."""
    if not units:
        return []
    if packed:
        bins = get_packer(algorithm)([_unit_len(batch, u) for u in units], mb_tokens)
        return [[i for j in b for i in units[j]] for b in bins]
    per = max(1, micro_batch_size // len(units[0]))
    return [[i for u in units[k:k + per] for i in u] for k in range(0, len(units), per)]


def _balance_tokens(batch: TrainBatch, units: list[list[int]], dp_size: int) -> list[list[list[int]]]:
    """`units` split over `dp_size` ranks, longest first to the rank with the fewest tokens (greedy LPT
    scheduling, within 4/3 of the best makespan); each share keeps batch order."""
    shares: list[list[list[int]]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for u in sorted(units, key=lambda v: -_unit_len(batch, v)):
        r = min(range(dp_size), key=lambda q: (load[q], q))
        shares[r].append(u)
        load[r] += _unit_len(batch, u)
    return [sorted(s) for s in shares]


def rank_micro_batches(batch: TrainBatch, idx: list[int], dp_rank: int, dp_size: int, *, packed: bool,
                       micro_batch_size: int, mb_tokens: int, algorithm: str, pad_id: int = 0,
                       unit: int = 1) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches for the sequences `idx` of one optimizer step.

    Packed, micro-batches are formed by tokens: sequences go to ranks balancing their token counts,
    then into bins of `mb_tokens` (`algorithm`: rlserve.training.packing). Padded, they are dealt out strided and cut
    into `micro_batch_size` rows. Every rank then gets as many micro-batches as the busiest rank
    (padded with dummies), because FSDP's collectives need the same number of forward/backward
    passes on every rank. Each rank sees the whole batch, so no communication is needed to agree.
    Which sequences share a micro-batch does not change the gradient: losses are normalised by
    the minibatch's global counts (`rlserve.training.objective`). With `unit` > 1, every `unit`
    consecutive sequences (a DPO pair) move as one: same rank, same micro-batch, in order.
    """
    units = [idx[k:k + unit] for k in range(0, len(idx), unit)]
    shares = _balance_tokens(batch, units, dp_size) if packed else [units[r::dp_size] for r in range(dp_size)]
    plans = [_groups(batch, share, packed, micro_batch_size, mb_tokens, algorithm) for share in shares]
    mine = [_make(batch, g, packed, pad_id) for g in plans[dp_rank]]
    missing = max(len(p) for p in plans) - len(mine)
    if missing:
        filler = (shares[dp_rank] or units)[0][:1]
        mine += [_make(batch, filler, packed, pad_id, dummy=True) for _ in range(missing)]
    return mine
