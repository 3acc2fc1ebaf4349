"""Checks of a rollout service's answers against the model they should come from."""

from __future__ import annotations

from pathlib import Path

from rlserve.reference.scorer import ReferenceScorer, Sequence
from rlserve.v1 import rollout_pb2


def logprob_errors(resp: rollout_pb2.GenerateResponse, model_dir: Path) -> list[list[float]]:
    """|served logprob - transformers logprob of `model_dir`| per token of every sample, in order."""
    seqs, lps = [], []
    for c in resp.completions:
        for s in c.samples:
            seqs.append(Sequence(list(c.prompt_token_ids) + list(s.token_ids), len(c.prompt_token_ids)))
            lps.append(list(s.logprobs))
    ref = ReferenceScorer(model_dir).logprobs(seqs)
    return [[abs(a - b) for a, b in zip(r, g)] for r, g in zip(ref, lps)]


def max_error(resp: rollout_pb2.GenerateResponse, model_dir: Path) -> float:
    return max(e for errors in logprob_errors(resp, model_dir) for e in errors)
