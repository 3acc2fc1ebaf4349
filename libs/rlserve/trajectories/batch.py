"""Groups of trajectories -> what the advantage estimator and the learner take."""

from __future__ import annotations

import base64

import numpy as np
import torch

from rlserve.algorithms.interfaces import AdvantageInputs
from rlserve.training.batch import TrainBatch
from rlserve.trajectories.trajectory import Group, Trajectory


def advantage_inputs(groups: list[Group], rewards: torch.Tensor, with_reference: bool) -> AdvantageInputs:
    """The estimator's inputs: rewards [G, n] and per-token tensors padded to the longest trajectory."""
    width = max(len(t.tokens) for g in groups for t in g.trajectories)
    shape = (len(groups), groups[0].size, width)
    mask, gen = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape)
    ref = torch.zeros(shape) if with_reference else None
    for i, g in enumerate(groups):
        for j, t in enumerate(g.trajectories):
            mask[i, j, :len(t.tokens)] = True
            gen[i, j, :len(t.tokens)] = torch.tensor(t.logprobs)
            if ref is not None:
                ref[i, j, :len(t.tokens)] = torch.tensor(t.ref_logprobs)
    return AdvantageInputs(rewards, mask, gen, ref)


def build_batch(groups: list[Group], advantages: torch.Tensor, with_reference: bool,
                version: int | None = None) -> TrainBatch:
    """One sequence per trajectory: its prompt and tokens exactly as generated (an episode's observations
    between turns included, which its loss mask leaves out of the loss; an external agent's episode whose
    history was rewritten is one sequence per stretch, `Trajectory.sequences`); `advantages` [G, n], or [G, n, T]
    from a token-level estimator. With `version` (the learner's at this step) each token carries its age
    in versions, and in a batch of multi-turn episodes its turn (the consistency metrics' splits)."""
    seqs, prompt_lens, advs, token_advs, gen_lps, ref_lps, masks = [], [], [], [], [], [], []
    ages, turns, routes = [], [], []
    multi_turn = any(t.turns > 1 for g in groups for t in g.trajectories)
    dims = next((t.route_dims for g in groups for t in g.trajectories if t.routes), None)
    per_token = advantages.dim() == 3
    for g, adv in zip(groups, advantages.tolist()):
        for j, t in enumerate(g.trajectories):
            token_ages = [version - v for v in t.token_versions(g.weight_version)] if version is not None else []
            token_turns = t.token_turns()
            # One sequence, or (an agent that rewrote its history) one per stretch, each with the advantage.
            for prompt, start, end in t.sequences(g.prompt_ids):
                seqs.append(prompt + t.tokens[start:end])
                prompt_lens.append(len(prompt))
                if per_token:
                    token_advs.append(adv[j][start:end])
                else:
                    advs.append(adv[j])
                gen_lps.append(t.logprobs[start:end])
                masks.append(t.mask[start:end])
                if with_reference:
                    ref_lps.append(t.ref_logprobs[start:end])
                if version is not None:
                    ages.append(token_ages[start:end])
                turns.append(token_turns[start:end])
                if dims is not None:
                    routes.append(route_rows(t, len(prompt) + end - start, dims))
    return TrainBatch.from_sequences(seqs, prompt_lens, None if per_token else advs, gen_lps,
                                     ref_lps if with_reference else None,
                                     token_advantages=token_advs if per_token else None,
                                     loss_mask=None if all(all(m) for m in masks) else masks,
                                     token_ages=ages if version is not None else None,
                                     token_turns=turns if multi_turn else None,
                                     routed_experts=routes if dims is not None else None)


def route_rows(t: Trajectory, length: int, dims: tuple[int, int]) -> torch.Tensor:
    """The trajectory's recorded routes [length, layers, k] over prompt + tokens, -1 where none was recorded
    (the last position; every position when the rollout sent none)."""
    out = torch.full((length, *dims), -1, dtype=torch.int16)
    if t.routes:
        data = np.frombuffer(base64.b64decode(t.routes), dtype="<i2").astype(np.int16)
        recorded = torch.from_numpy(data).view(-1, *t.route_dims)[:length]
        out[:len(recorded)] = recorded
    return out
