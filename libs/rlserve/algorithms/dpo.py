"""DPO (Rafailov et al. 2023, arXiv:2305.18290): an `algorithm: dpo` run on a preference file.

Each pair's chosen and rejected response (the prompt with one response each) go side by side, chosen
first, with the reference policy's logprobs of both from the reference service (the model the run
starts from); the `dpo` loss (`losses/dpo.py`) declares itself paired, so the learner keeps a pair in
one micro-batch. Sequences longer than `policy.max_total_sequence_length` are cut to it; a pair left
with nothing to train is skipped and counted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from rlserve.algorithms.supervised import Supervised, SupervisedBatch, truncated
from rlserve.config import RunSpec
from rlserve.data.preferences import PreferencePair, build_preference_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.loop.services import RunServices
from rlserve.training.batch import TrainBatch
from rlserve.v1 import reference_pb2


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


class Dpo(Supervised):
    unit = "pairs"
    trains_on_pairs = True
    section = "dpo"
    loss = "dpo"

    @classmethod
    def data(cls, spec: RunSpec) -> tuple[list, list]:
        return build_preference_splits(spec.data).train, []

    async def build(self, items: list[Any], max_len: int) -> SupervisedBatch:
        inputs = self.attempt.inputs
        return await dpo_batch(self.attempt.services, inputs.tok, items, max_len, inputs.model_path)
