"""A GRPO batch both learner backends' tests train on."""

from __future__ import annotations

import torch

from rlserve.training.batch import TrainBatch


def random_grpo_batch(seed: int) -> TrainBatch:
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
    return TrainBatch.from_sequences(seqs, prompts, advs, gen, ref)
