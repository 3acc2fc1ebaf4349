"""The learner's batches of supervised training: SFT (the warm start and `algorithm: sft`) and DPO.

SFT trains on the assistant's tokens of each example (`PromptTokenizer.sft_tokens`: the answer,
and a chat row's earlier assistant turns), through `TrainBatch.loss_mask`. DPO puts each pair's
chosen and rejected response (the prompt with one response each) side by side, chosen first, with
the reference policy's logprobs from the reference service. Sequences longer than
`policy.max_total_sequence_length` are cut to it; an example left with nothing to train is
skipped and counted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlserve.data.preferences import PreferencePair
from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.grpo.services import RunServices
from rlserve.training.batch import TrainBatch
from rlserve.v1 import reference_pb2


@dataclass
class SupervisedBatch:
    batch: TrainBatch | None  # None when every example was skipped
    trained: int  # examples (DPO: pairs) in the batch
    skipped: int  # examples with no trainable token within the length limit
    metrics: dict[str, float] = field(default_factory=dict)


def truncated(ids: list[int], mask: list[bool], max_len: int) -> tuple[list[int], int, list[bool]] | None:
    """(ids cut to max_len, the first trained position, the loss mask from there); None if nothing is left
    to train (position 0 predicts nothing, so training starts at 1 at the earliest)."""
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask[1:]):
        return None
    start = max(1, mask.index(True))
    return ids, start, mask[start:]


def sft_batch(tok: PromptTokenizer, examples: list[Example], max_len: int) -> SupervisedBatch:
    seqs, starts, masks = [], [], []
    for ex in examples:
        cut = truncated(*tok.sft_tokens(ex), max_len)
        if cut is not None:
            seqs.append(cut[0])
            starts.append(cut[1])
            masks.append(cut[2])
    batch = TrainBatch.from_sequences(seqs, starts, loss_mask=masks) if seqs else None
    return SupervisedBatch(batch, len(seqs), len(examples) - len(seqs))


def _response(tok: PromptTokenizer, pair: PreferencePair, response: str, max_len: int
              ) -> tuple[list[int], int] | None:
    """The prompt with one response, trained on the response alone (not on earlier assistant turns)."""
    ids, prompt_len = tok.sft_ids(pair.example(response))
    cut = truncated(ids, [False] * prompt_len + [True] * (len(ids) - prompt_len), max_len)
    return None if cut is None else (cut[0], cut[1])


def _pair_sequences(tok: PromptTokenizer, pairs: list[PreferencePair], max_len: int) -> list[tuple[list[int], int]]:
    """(ids, first trained position) of every pair that fits, chosen then rejected."""
    seqs: list[tuple[list[int], int]] = []
    for pair in pairs:
        chosen, rejected = _response(tok, pair, pair.chosen, max_len), _response(tok, pair, pair.rejected, max_len)
        if chosen is not None and rejected is not None:
            seqs += [chosen, rejected]
    return seqs


async def dpo_batch(services: RunServices, tok: PromptTokenizer, pairs: list[PreferencePair], max_len: int,
                    reference_model: Path) -> SupervisedBatch:
    seqs = await asyncio.to_thread(_pair_sequences, tok, pairs, max_len)
    trained = len(seqs) // 2
    if not seqs:
        return SupervisedBatch(None, 0, len(pairs))
    t0 = time.perf_counter()
    ref = await services.reference_logprobs(reference_pb2.LogProbsRequest(
        model_path=str(reference_model),
        sequences=[reference_pb2.ScoredSequence(token_ids=ids, prompt_length=start) for ids, start in seqs]))
    seconds = time.perf_counter() - t0
    batch = TrainBatch.from_sequences([ids for ids, _ in seqs], [start for _, start in seqs], None, None,
                                      [list(s.logprobs) for s in ref.sequences])
    return SupervisedBatch(batch, trained, len(pairs) - trained, {
        "timing/reference_s": seconds, "plumbing/reference_s": seconds - ref.compute_seconds})
