"""MoE routing replay in both learner backends (gloo, CPU, fp32; Megatron with tests/support/megatron_cpu.py),
on the Mixtral-shaped and the Qwen3-MoE-shaped presets: a batch whose recorded routes send every token to
other experts than its router would choose gives, in the dtensor and in the Megatron backend, exactly the
logprobs of the HF model replaying those routes (padded and packed), far from the logprobs without replay;
and replay trains (a step's loss and gradient take the replayed experts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from rlserve.config import parse_spec
from rlserve.models import moe_routing, resolve_model
from rlserve.models.architecture import load_causal_lm
from rlserve.training.batch import TrainBatch
from rlserve.training.objective import StepObjective
from tests.support.batches import random_grpo_sequences
from tests.support.dist import run_ranks

PRESETS = ["moe-tiny", "qwen3-moe-tiny"]


def spec_dict(model: str, backend: str, packed: bool) -> dict:
    policy = {"model_name": model, "train_micro_batch_size": 4, "max_total_sequence_length": 32,
              "generation": {"max_new_tokens": 8}, "routing_replay": True,
              "sequence_packing": {"enabled": packed, "train_mb_tokens": 64}}
    if backend == "megatron":
        policy["megatron_cfg"] = {"enabled": True}
    return {"policy": policy, "loss_fn": {"use_importance_sampling_correction": True}}


def shifted_routes(model_name: str) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
    """A batch routed to (own + 1) mod experts everywhere but each sequence's last position, and the HF
    model's completion logprobs with that replay and without it."""
    seqs, prompts, advs, gen, _ = random_grpo_sequences(3)
    seqs, prompts, advs, gen = seqs[:8], prompts[:8], advs[:8], gen[:8]
    model = load_causal_lm(resolve_model(f"preset:{model_name}"), torch.float32).eval()
    experts = moe_routing.routers(model)[0].num_experts
    routes, replayed, plain = [], [], []
    with torch.no_grad():
        for ids, p in zip(seqs, prompts):
            with moe_routing.capture(model) as calls:
                plain.append(_completion(model, ids, p))
            own = torch.stack([c[0] for c in calls], dim=1)
            shifted = (own + 1) % experts
            shifted[-1] = -1  # the last position has no recorded route
            routes.append(shifted)
            with moe_routing.replay(model, shifted):
                replayed.append(_completion(model, ids, p))
    batch = TrainBatch.from_sequences(seqs, prompts, advs, gen, routed_experts=routes)
    return batch, torch.cat(replayed), torch.cat(plain)


def _completion(model, ids: list[int], p: int) -> torch.Tensor:
    logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logits[p - 1:-1].gather(-1, torch.tensor(ids[p:])[:, None]).squeeze(-1)


def backend_logprobs(rank: int, world: int, cases: list[tuple[str, str, bool, TrainBatch]]) -> list:
    """For each (model, backend, packed, batch): the backend's completion logprobs of `batch` (replaying its
    routes) in batch order, and one training step's metrics. One process for all: importing Megatron and
    starting the process are most of the cost."""
    return [_one(model, backend_name, packed, batch) for model, backend_name, packed, batch in cases]


def _one(model: str, backend_name: str, packed: bool, batch: TrainBatch):
    from rlserve.learner import make_backend
    from tests.support.megatron_cpu import megatron_cpu_training

    spec = parse_spec(spec_dict(f"preset:{model}", backend_name, packed))
    with megatron_cpu_training() if backend_name == "megatron" else _nothing():
        backend = make_backend(spec, resolve_model(spec.policy.model_name), torch.device("cpu"))
        objective = StepObjective(spec, batch, "grpo", 1, 0, backend.pad_id)
        (plan,) = objective.plans
        with torch.no_grad():
            per_mb = (backend._forward_logprobs(plan) if backend_name == "megatron"
                      else [backend._logprobs(mb) for mb in plan])
        # Back to batch order: each micro-batch's flat completion tokens, by its sequences' completion offsets.
        out = torch.zeros(int(batch.completion_lens.sum()))
        starts = torch.cumsum(batch.completion_lens, 0) - batch.completion_lens
        for mb, lps in zip(plan, per_mb):
            seqs = _sequences_of(batch, mb)
            pos = torch.cat([torch.arange(int(starts[i]), int(starts[i] + batch.completion_lens[i])) for i in seqs])
            out[pos] = lps.detach().float()
        metrics = backend.train_step(batch, "grpo").metrics
    return out, metrics


def _sequences_of(batch: TrainBatch, mb) -> list[int]:
    """Which batch sequences a micro-batch holds, in its order (matched by their tokens)."""
    rows = mb.input_ids.tolist() if not mb.packed else None
    found = []
    if rows is not None:
        for row in rows:
            found.append(next(i for i in range(batch.num_seqs) if i not in found
                              and batch.sequence(i).tolist() == row[:int(batch.seq_lens[i])]))
        return found
    flat, at = mb.input_ids[0].tolist(), 0
    while at < len(flat):
        i = next(i for i in range(batch.num_seqs) if i not in found
                 and batch.sequence(i).tolist() == flat[at:at + int(batch.seq_lens[i])])
        found.append(i)
        at += int(batch.seq_lens[i])
    return found


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_both_backends_replay_the_recorded_experts_exactly():
    batches = {model: shifted_routes(model) for model in PRESETS}
    for batch, replayed, plain in batches.values():
        assert (replayed - plain).abs().max() > 1e-2  # the routes really move the logprobs
    cases = [(model, backend_name, packed, batches[model][0]) for model in PRESETS
             for backend_name in ("dtensor", "megatron") for packed in (False, True)]
    (results,) = run_ranks(1, backend_logprobs, cases)
    for (model, backend_name, packed, batch), (got, metrics) in zip(cases, results):
        torch.testing.assert_close(got, batches[model][1], atol=2e-5, rtol=0,
                                   msg=lambda m, c=(model, backend_name, packed): f"{c}: {m}")
        assert metrics["batch/valid_tokens"] == float(batch.completion_lens.sum())
        assert metrics["mismatch/token_mult_prob_error"] > 1.0  # the generator logprobs are random here
