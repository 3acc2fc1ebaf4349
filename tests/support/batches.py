"""A GRPO batch both learner backends' tests train on."""

from __future__ import annotations

import torch

from rlserve.training.batch import TrainBatch


def random_grpo_sequences(seed: int) -> tuple[list[list[int]], list[int], list[float], list[list[float]],
                                              list[list[float]]]:
    """12 sequences of random prompt (3-7) and completion (2-8) lengths over token ids 4..59
    (every preset has 62 tokens), with random advantages and generator/reference logprobs."""
    g = torch.Generator().manual_seed(seed)
    seqs, prompts, advs, gen, ref = [], [], [], [], []
    for _ in range(12):
        p, c = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
        seqs.append(torch.randint(4, 60, (p + c,), generator=g).tolist())
        prompts.append(p)
        advs.append(float(torch.randn(1, generator=g)))
        gen.append((-2 - torch.rand(c, generator=g)).tolist())
        ref.append((-2 - torch.rand(c, generator=g)).tolist())
    return seqs, prompts, advs, gen, ref


def random_grpo_batch(seed: int) -> TrainBatch:
    return TrainBatch.from_sequences(*random_grpo_sequences(seed))


def completion_logprobs(model: torch.nn.Module, seqs: list[list[int]], prompts: list[int]) -> torch.Tensor:
    """Logprobs of every completion token under an HF causal LM, one sequence at a time, concatenated."""
    out = []
    with torch.no_grad():
        for ids, p in zip(seqs, prompts):
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            lps = torch.log_softmax(logits[p - 1:len(ids) - 1], dim=-1)
            out.append(lps.gather(1, torch.tensor(ids[p:]).unsqueeze(1)).squeeze(1))
    return torch.cat(out)
