"""Activation checkpointing of a share of the decoder layers (policy.dtensor_cfg.activation_checkpointing_fraction):
the layers are spread over the stack, and a checkpointed step trains exactly what an unchecked one does, for full
fine-tuning and LoRA; a LoRA learner that computes its own reference logprobs reports how long that took."""

from __future__ import annotations

import pytest
import torch

from rlserve.config import parse_spec
from rlserve.learner.dtensor.parallelize import checkpointed_layers
from rlserve.models import resolve_model
from rlserve.training.batch import TrainBatch
from tests.support.batches import random_grpo_sequences
from tests.support.dist import run_ranks


def test_the_checkpointed_layers_are_spread_over_the_stack():
    assert checkpointed_layers(16, 0.25) == [3, 7, 11, 15]
    assert checkpointed_layers(16, 1.0) == list(range(16))
    assert checkpointed_layers(16, 0.125) == [7, 15]
    assert checkpointed_layers(2, 0.5) == [1]


def _spec(lora: bool, fraction: float | None) -> dict:
    dtensor = {"activation_checkpointing": fraction is not None, "activation_checkpointing_fraction": fraction or 1.0}
    if lora:
        dtensor["lora_cfg"] = {"enabled": True, "dim": 4}
    return {"policy": {"dtensor_cfg": dtensor, "train_global_batch_size": 6, "train_micro_batch_size": 2,
                       "max_total_sequence_length": 32, "generation": {"max_new_tokens": 8}},
            "loss_fn": {"reference_policy_kl_penalty": 0.05, "use_importance_sampling_correction": True}}


def _train(rank: int, world: int, specs: list[dict]) -> list[tuple[list[float], dict, list[str]]]:
    from rlserve.learner.dtensor.backend import DTensorBackend

    out = []
    for spec in specs:
        torch.manual_seed(0)
        backend = DTensorBackend(parse_spec(spec), resolve_model("preset:tiny"), torch.device("cpu"))
        lora = "lora_cfg" in spec["policy"]["dtensor_cfg"]
        seqs, prompts, advs, gen, ref = random_grpo_sequences(0)
        # A LoRA run's batch carries no reference logprobs: its learner computes them (adapters off).
        metrics = backend.train_step(TrainBatch.from_sequences(seqs, prompts, advs, gen, None if lora else ref),
                                     "grpo").metrics
        weights = {n: t.clone() for n, t in backend.export_weights()}
        out.append(([metrics["loss/total"]], weights, sorted(metrics)))
    return out


def test_a_share_of_layers_checkpointed_trains_what_none_does():
    (runs,) = run_ranks(1, _train, [_spec(lora, fraction) for lora in (False, True) for fraction in (None, 0.5)])
    for lora, (plain, *checkpointed) in ((False, runs[:2]), (True, runs[2:])):
        plain_losses, plain_weights, keys = plain
        for losses, weights, _ in checkpointed:
            assert losses == pytest.approx(plain_losses, abs=1e-6)
            assert weights.keys() == plain_weights.keys()  # the wrapper's prefix never reaches the exported names
            for name in weights:
                torch.testing.assert_close(weights[name], plain_weights[name], atol=1e-6, rtol=1e-5, msg=name)
        # A LoRA learner computes its reference logprobs with its adapters off, and says how long that took.
        assert ("perf/learner_reference_seconds" in keys) == lora
        assert "perf/learner_peak_allocated_gib" not in keys  # on a GPU only


def test_runs_that_checkpoint_different_layers_still_share_their_frozen_base():
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from rlserve.learner.shared_base import SharedBases

    def model(wrapped: bool) -> nn.Module:
        torch.manual_seed(0)
        layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        if wrapped:
            layers[1] = checkpoint_wrapper(layers[1], preserve_rng_state=False)
        for p in layers.parameters():
            p.requires_grad_(False)
        return nn.Sequential(*layers)

    bases, first, second = SharedBases(), model(False), model(True)
    bases.share(("base",), "run-1", first)
    assert bases.share(("base",), "run-2", second) == 2 * (16 + 4) * 4  # both layers' weights and biases
    assert second[1]._checkpoint_wrapped_module.weight is first[1].weight
