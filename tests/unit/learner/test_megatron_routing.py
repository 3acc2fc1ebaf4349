"""Megatron's routing-replay targets: recorded routes [b, s, layers, k] in the sequence-major order its routers
see, unrecorded positions given experts 0..k-1, and the layouts replay refuses, naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlserve.learner.megatron.routing import refusal, targets


def test_targets_are_sequence_major_per_layer_and_fill_what_was_not_recorded():
    routes = torch.tensor([[[[3, 1]], [[2, 0]], [[-1, -1]]],       # sequence 0: 3 positions, the last unrecorded
                           [[[1, 2]], [[-1, -1]], [[-1, -1]]]],    # sequence 1: padding after its first
                          dtype=torch.int16)                        # [b=2, s=3, layers=1, k=2]
    (layer,) = targets(routes, rows=2, width=4)  # padded to 4 positions
    assert layer.tolist() == [[3, 1], [1, 2],   # position 0 of each row, then position 1, ...
                              [2, 0], [0, 1],
                              [0, 1], [0, 1],
                              [0, 1], [0, 1]]
    assert layer.dtype == torch.long


def test_replay_refuses_layouts_whose_routers_see_part_of_a_sequence():
    layout = SimpleNamespace(pp=1, cp=1, sequence_parallel=False)
    assert refusal(layout, recompute=False) == ""
    assert refusal(SimpleNamespace(pp=2, cp=1, sequence_parallel=False), False).startswith(
        "policy.megatron_cfg.pipeline_model_parallel_size")
    assert refusal(SimpleNamespace(pp=1, cp=1, sequence_parallel=True), False).startswith(
        "policy.megatron_cfg.sequence_parallel")
    assert refusal(layout, recompute=True).startswith("policy.megatron_cfg.activation_checkpointing")
