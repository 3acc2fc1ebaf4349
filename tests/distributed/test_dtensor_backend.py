"""The DTensor/FSDP2 backend on gloo: 2 ranks (FSDP, TP, TP+SP) match 1 rank, packing matches
padding (also on 2 ranks), and save -> load -> continue is bit-identical to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from rlserve.config import parse_spec
from rlserve.models import resolve_model
from tests.support.batches import random_grpo_batch
from tests.support.dist import run_ranks, run_ranks_in_turn

STEPS = 3


def spec_dict(world: int, tp: int = 1, sp: bool = False, packed: bool = False, **loss) -> dict:
    return {"policy": {"dtensor_cfg": {"tensor_parallel_size": tp, "sequence_parallel": sp},
                       "train_global_batch_size": 6, "train_micro_batch_size": 2, "max_total_sequence_length": 32,
                       "generation": {"max_new_tokens": 8},
                       "sequence_packing": {"enabled": packed, "train_mb_tokens": 40}},
            "cluster": {"num_workers": world},
            "loss_fn": {"reference_policy_kl_penalty": 0.05, "use_importance_sampling_correction": True, **loss}}


def train(rank: int, world: int, spec: dict, steps: int, save_to: str | None = None, load: str | None = None):
    from pathlib import Path

    from rlserve.learner.dtensor.backend import DTensorBackend

    backend = DTensorBackend(parse_spec(spec), resolve_model("preset:tiny"), torch.device("cpu"))
    if load:
        backend.load_checkpoint(Path(load))
    losses = []
    for _ in range(steps):
        losses.append(backend.train_step(random_grpo_batch(backend.version), "grpo").metrics["loss/total"])
    if save_to:
        backend.save_checkpoint(Path(save_to))
    weights = {n: t.clone() for n, t in backend.export_weights()}
    return losses, (weights if rank == 0 else None), backend.version


# The module's runs without a checkpoint to load, by name: (world, spec, steps). The runs of one world size
# share one spawn (`run_ranks_in_turn`); each restore gets fresh processes.
RUNS = {
    "reference": (1, spec_dict(1), STEPS),
    "packed": (1, spec_dict(1, packed=True), STEPS),
    "icepop": (1, spec_dict(1, token_level_loss=False, truncated_importance_sampling_type="icepop"), 1),
    "fsdp2": (2, spec_dict(2), STEPS),
    "tp2": (2, spec_dict(2, tp=2), STEPS),
    "tp2_sp": (2, spec_dict(2, tp=2, sp=True), STEPS),
    "fsdp2_packed": (2, spec_dict(2, packed=True), STEPS),
    "tp2_sp_packed": (2, spec_dict(2, tp=2, sp=True, packed=True), STEPS),
    "uninterrupted": (2, spec_dict(2), 4),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Where the two-rank run saved after 2 steps (in the shared spawn) for the reload test."""
    return str(tmp_path_factory.mktemp("dtensor") / "ckpt")


@pytest.fixture(scope="module")
def runs(checkpoint) -> dict[str, list]:
    """Per-rank results of every run in `RUNS`, and `saved`: 2 steps on 2 ranks, then a checkpoint."""
    out = {}
    for world in (1, 2):
        calls = {name: (train, spec, steps) for name, (w, spec, steps) in RUNS.items() if w == world}
        if world == 2:
            calls["saved"] = (train, spec_dict(2), 2, checkpoint)
        out.update(run_ranks_in_turn(world, calls))
    return out


@pytest.fixture(scope="module")
def reference_run(runs):
    return runs["reference"][0]


def assert_same(a, b, atol=2e-5):
    losses_a, w_a, _ = a
    losses_b, w_b, _ = b
    assert losses_a == pytest.approx(losses_b, abs=atol)
    assert w_a.keys() == w_b.keys()
    for name in w_a:
        torch.testing.assert_close(w_a[name], w_b[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_sp"])
def test_two_ranks_match_one(runs, reference_run, layout):
    results = runs[layout]
    assert_same(reference_run, results[0])
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)  # every rank reports the same metrics


def test_packed_matches_padded(runs, reference_run):
    assert_same(reference_run, runs["packed"][0])


@pytest.mark.parametrize("layout", ["fsdp2", "tp2_sp"])
def test_packed_on_two_ranks_matches_one(runs, reference_run, layout):
    """Packed attention under FSDP (ranks get token-balanced shares) and under TP + SP (local heads)."""
    assert_same(reference_run, runs[f"{layout}_packed"][0])


def test_save_load_continue_is_bit_identical(runs, checkpoint):
    """A checkpoint saved after 2 steps, loaded by new processes, continues as the uninterrupted run did."""
    full = runs["uninterrupted"][0]
    resumed = run_ranks(2, train, spec_dict(2), 2, None, checkpoint)[0]
    assert runs["saved"][0][2] == 2 and resumed[2] == 4
    assert resumed[0] == full[0][2:]  # exact equality of the losses after the reload
    for name, tensor in full[1].items():
        assert torch.equal(tensor, resumed[1][name]), name


def test_sequence_level_loss_and_icepop_run(runs, reference_run):
    result = runs["icepop"][0]
    assert result[0][0] != reference_run[0][0]
