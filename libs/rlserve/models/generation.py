"""What every caller of transformers' `generate` on a model does alike (the transformers rollout engine,
a generative judge): stop on every EOS id the model declares, pad with its pad id (an EOS id when it
has none), and pad prompts on the left, as decoder-only generation wants."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every EOS id of the model: the tokenizer's and the generation config's (Llama-3.x-Instruct lists
    several there), as vLLM stops on them all."""
    eos = model.generation_config.eos_token_id
    return {*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id} - {None}


def pad_id(tokenizer: Any, eos: set[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)


def left_padded(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """(input ids, attention mask) [len(rows), longest] with each row on the right."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention[i, width - len(ids):] = 1
    return input_ids, attention
