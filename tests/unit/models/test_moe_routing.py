"""MoE routing capture and replay on transformers' Mixtral and Qwen3-MoE: what the transformers engine records
while generating is each token's routing under a teacher-forced pass; replaying a model's own routes changes
nothing, bit for bit; replaying other experts changes the logprobs and the router still gets a gradient; a
trajectory's routes over several turns cover each position once, and the batch lines them up with its tokens."""

from __future__ import annotations

import pytest
import torch

from rlserve.models import moe_routing, resolve_model
from rlserve.models.architecture import load_causal_lm
from rlserve.rollout.hf_engine import TransformersEngine
from rlserve.rollout.interfaces import EngineConfig, SamplingSpec
from rlserve.rollout.samples import sample_proto
from rlserve.trajectories.batch import build_batch
from rlserve.trajectories.trajectory import Group, Trajectory

PRESETS = ["moe-tiny", "qwen3-moe-tiny"]  # Mixtral-shaped, Qwen3-MoE-shaped
PROMPTS = [[8, 11, 41, 12, 9, 47], [5, 6, 42, 7]]


def completion_logprobs(model, seq: list[int], prompt_len: int) -> torch.Tensor:
    logits = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    return logits[prompt_len - 1:-1].gather(-1, torch.tensor(seq[prompt_len:])[:, None]).squeeze(-1)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_engine_records_the_routing_a_teacher_forced_pass_chooses(preset):
    engine = TransformersEngine(EngineConfig(model_path=resolve_model(f"preset:{preset}"), device="cpu"))
    assert engine.routing_unavailable == ""
    out = engine.generate(PROMPTS, 2, SamplingSpec(temperature=1.0, max_new_tokens=6, seed=3, routed_experts=True))
    for prompt, samples in zip(PROMPTS, out):
        for s in samples:
            seq = prompt + s.token_ids
            with torch.no_grad(), moe_routing.capture(engine.model) as calls:
                engine.model(torch.tensor([seq]))
            own = torch.stack([c[0] for c in calls], dim=1)
            assert s.routed_experts.shape == (len(seq) - 1, 2, 2)  # every position but the last; 2 layers, top-2
            assert torch.equal(s.routed_experts, own[:-1])


def test_a_dense_model_records_no_routing():
    engine = TransformersEngine(EngineConfig(model_path=resolve_model("preset:tiny"), device="cpu"))
    assert engine.routing_unavailable == "the model has no MoE layers"


@pytest.mark.parametrize("preset", PRESETS)
def test_replay_of_the_own_routes_is_exact_and_of_others_moves_logprobs_with_a_router_gradient(preset):
    model = load_causal_lm(resolve_model(f"preset:{preset}"), torch.float32).eval()
    seq, prompt_len = [8, 11, 41, 12, 9, 47, 30, 31, 5], 6
    with torch.no_grad(), moe_routing.capture(model) as calls:
        plain = completion_logprobs(model, seq, prompt_len)
    own = torch.stack([c[0] for c in calls], dim=1)
    with torch.no_grad(), moe_routing.replay(model, own):
        assert torch.equal(completion_logprobs(model, seq, prompt_len), plain)
    # Unrecorded rows (-1) route themselves.
    with torch.no_grad(), moe_routing.replay(model, torch.full_like(own, -1)):
        assert torch.equal(completion_logprobs(model, seq, prompt_len), plain)
    other = (own + 1) % 4  # every token to other experts
    with moe_routing.replay(model, other):
        moved = completion_logprobs(model, seq, prompt_len)
        moved.sum().backward()
    assert (moved.detach() - plain).abs().max() > 1e-3
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routing.routers(model))
    assert "forward" not in vars(moe_routing.routers(model)[0])  # the class's forward is back
    with pytest.raises(ValueError, match="routes for 3 MoE layers, the model has 2"):
        with moe_routing.replay(model, torch.zeros(len(seq), 3, 2, dtype=torch.int16)):
            pass


def test_a_trajectorys_routes_cover_each_position_once_over_turns_and_line_up_in_the_batch():
    engine = TransformersEngine(EngineConfig(model_path=resolve_model("preset:qwen3-moe-tiny"), device="cpu"))
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=4, min_new_tokens=4, seed=1, routed_experts=True)
    prompt, observation = [8, 11, 41], [20, 21]
    traj = Trajectory()
    first = engine.generate([prompt], 1, sampling)[0][0]
    traj.add(first.token_ids, first.logprobs)
    traj.add_routes(sample_proto(first).routed_experts)
    traj.add(observation, None)
    second = engine.generate([prompt + traj.tokens], 1, sampling)[0][0]
    traj.add(second.token_ids, second.logprobs)
    traj.add_routes(sample_proto(second).routed_experts)
    length = len(prompt) + len(traj.tokens)
    batch = build_batch([Group(0, prompt, [traj], 0)], torch.tensor([[1.0]]), with_reference=False)
    routes = batch.routed_experts
    assert routes.shape == (length, 2, 2) and (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
    # The first call's routes for its positions, the second's for the rest (observation and second turn).
    covered = len(prompt) + len(first.token_ids) - 1
    assert torch.equal(routes[:covered], first.routed_experts)
    assert torch.equal(routes[covered:-1], second.routed_experts[covered:])
