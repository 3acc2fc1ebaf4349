"""Logprobs of given sequences under a frozen causal LM (transformers), batched by a token budget.

The decoder runs with the attention kernel the architecture needs and only completion positions
are projected onto the vocabulary, followed by the model's own logit soft-capping or scaling
(`rlserve.models.architecture`): the numbers are those of the model's ForCausalLM forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlserve.devices import resolve_device
from rlserve.dtypes import torch_dtype
from rlserve.models.architecture import OutputLogits, load_causal_lm
from rlserve.training.forward import completion_positions, gather_logprobs


@dataclass(frozen=True)
class Sequence:
    token_ids: list[int]
    prompt_length: int


class ReferenceScorer:
    def __init__(self, model_path: Path, dtype: str = "float32", token_budget: int = 8192, device: str = "auto"):
        self.device = resolve_device(device)
        self.model = load_causal_lm(model_path, torch_dtype(dtype)).to(self.device).eval()
        self.output_logits = OutputLogits.from_config(self.model.config)
        self.model_path = str(model_path)
        self.vocab_size = self.model.config.vocab_size
        self.max_len = self.model.config.max_position_embeddings
        self.token_budget = token_budget

    def _batches(self, seqs: list[Sequence]) -> list[list[int]]:
        """Indices grouped so that (rows x longest row) stays within the token budget."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids))
        batches, current, longest = [], [], 0
        for i in order:
            n = len(seqs[i].token_ids)
            if current and max(longest, n) * (len(current) + 1) > self.token_budget:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, n)
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def logprobs(self, seqs: list[Sequence]) -> list[list[float]]:
        results: list[list[float]] = [[] for _ in seqs]
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings().weight
        for batch in self._batches(seqs):
            width = max(len(seqs[i].token_ids) for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            attn = torch.zeros_like(ids)
            completion = torch.zeros_like(ids, dtype=torch.bool)
            for row, i in enumerate(batch):  # right padding: positions start at 0 for every row
                s = seqs[i]
                ids[row, :len(s.token_ids)] = torch.tensor(s.token_ids)
                attn[row, :len(s.token_ids)] = 1
                completion[row, s.prompt_length:len(s.token_ids)] = True
            ids, attn, completion = ids.to(self.device), attn.to(self.device), completion.to(self.device)
            hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state
            select = completion_positions(completion)
            lps, _ = gather_logprobs(hidden[select], head, ids[completion],
                                     logits_fn=None if self.output_logits.identity else self.output_logits)
            lps = lps.cpu().tolist()
            offset = 0
            for row, i in enumerate(batch):
                n = int(completion[row].sum())
                results[i] = lps[offset:offset + n]
                offset += n
        return results
