"""The Megatron-Core backend on gloo (CPU, fp32, with the cuda->cpu shim of tests/support/megatron_cpu.py).

- Convergence parity: 5 GRPO steps (KL penalty, importance-sampling correction, 2 optimizer
  updates per step, warm-up + cosine lr) give the dtensor backend's per-step losses to 1e-6
  and its exported weights to 2e-5 (the dtensor tests' own tolerance between layouts);
  measured here: 3e-8 and 3e-6. SFT steps and an lr override agree the same way.
- 2 ranks as DP, TP and PP match 1 rank (losses, grad norm, entropy, weights); packing
  matches padding (also under PP and TP); moe-tiny trains and exports with EP 1 and EP 2 (which
  agree); export names and shapes are the HF checkpoint's.
- Save -> load -> continue is bit-identical to an uninterrupted run (distributed optimizer, DP 2).
- Unknown passthrough keys are refused with close matches; without CUDA (and without the
  test shim) the backend refuses to start; the automatic layout rule picks TP/PP/EP sizes.

Each spawned world runs several scenarios in a row (the backend re-creates Megatron's
parallel state), since starting processes and importing Megatron is most of the cost.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from rlserve.config import parse_spec
from rlserve.models import resolve_model
from rlserve.weights.specs import checkpoint_specs
from tests.support.batches import random_grpo_batch
from tests.support.dist import run_ranks

STEPS = 5
LOSS_ATOL = 1e-6
WEIGHT_ATOL = 2e-5


def spec_dict(world: int, backend: str = "megatron", model: str = "preset:tiny", packed: bool = False,
              **megatron) -> dict:
    policy = {"model_name": model, "train_global_batch_size": 6, "train_micro_batch_size": 2,
              "max_total_sequence_length": 32, "generation": {"max_new_tokens": 8},
              "sequence_packing": {"enabled": packed, "train_mb_tokens": 40},
              "scheduler": {"warmup_steps": 2, "decay": "cosine"}}
    if backend == "megatron":
        policy["megatron_cfg"] = {"enabled": True, **megatron}
    return {"policy": policy, "cluster": {"num_workers": world}, "grpo": {"max_num_steps": STEPS},
            "loss_fn": {"reference_policy_kl_penalty": 0.05, "use_importance_sampling_correction": True}}


def train(rank: int, spec: dict, steps: int, save_to: str | None = None, load: str | None = None,
          loss: str = "grpo", lr_at: dict[int, float] | None = None) -> dict:
    """Build the spec's backend, optionally load, take `steps` steps (lr overridden at the versions in
    `lr_at`), optionally save, export."""
    from rlserve.learner import make_backend

    parsed = parse_spec(spec)
    backend = make_backend(parsed, resolve_model(parsed.policy.model_name), torch.device("cpu"))
    if load:
        backend.load_checkpoint(Path(load))
    lr_at = lr_at or {}
    metrics = [backend.train_step(random_grpo_batch(backend.version), loss, lr_at.get(backend.version)).metrics
               for _ in range(steps)]
    if save_to:
        backend.save_checkpoint(Path(save_to))
    exported = list(backend.export_weights())
    return {"losses": [m["loss/total"] for m in metrics], "metrics": metrics, "version": backend.version,
            "layout": backend.info().parallel_layout, "names": [n for n, _ in exported],
            "weights": {n: t.clone() for n, t in exported} if rank == 0 else None}


def scenarios(rank: int, world: int, runs: list[tuple[str, str, dict, int, dict]]) -> dict:
    """Run (name, backend, spec, steps, kwargs) scenarios in a row on this rank."""
    from tests.support.megatron_cpu import megatron_cpu_training

    out = {}
    for name, backend, spec, steps, kwargs in runs:
        if backend == "megatron":
            with megatron_cpu_training():
                out[name] = train(rank, spec, steps, **kwargs)
        else:
            out[name] = train(rank, spec, steps, **kwargs)
    return out


@pytest.fixture(scope="module", autouse=True)
def presets() -> None:
    """Generate the models once, here, rather than concurrently in the spawned ranks."""
    for name in ("tiny", "moe-tiny"):
        resolve_model(f"preset:{name}")


@pytest.fixture(scope="module")
def world1() -> dict:
    (result,) = run_ranks(1, scenarios, [
        ("dtensor", "dtensor", spec_dict(1, backend="dtensor"), STEPS, {}),
        ("megatron", "megatron", spec_dict(1), STEPS, {}),
        ("dtensor_sft_lr", "dtensor", spec_dict(1, backend="dtensor"), 3, {"loss": "sft", "lr_at": {1: 3e-4}}),
        ("megatron_sft_lr", "megatron", spec_dict(1), 3, {"loss": "sft", "lr_at": {1: 3e-4}}),
        ("packed", "megatron", spec_dict(1, packed=True), STEPS, {}),
        ("moe", "megatron", spec_dict(1, model="preset:moe-tiny"), 2, {}),
    ])
    return result


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    ckpt = str(tmp_path_factory.mktemp("megatron-ckpt") / "step2")
    return run_ranks(2, scenarios, [
        ("dp2", "megatron", spec_dict(2), STEPS, {}),
        ("tp2", "megatron", spec_dict(2, tensor_model_parallel_size=2), STEPS, {}),
        ("pp2", "megatron", spec_dict(2, pipeline_model_parallel_size=2), STEPS, {}),
        ("pp2_packed", "megatron", spec_dict(2, packed=True, pipeline_model_parallel_size=2), STEPS, {}),
        ("tp2_packed", "megatron", spec_dict(2, packed=True, tensor_model_parallel_size=2), STEPS, {}),
        ("moe_ep2", "megatron", spec_dict(2, model="preset:moe-tiny", expert_model_parallel_size=2), 2, {}),
        ("full", "megatron", spec_dict(2), 4, {}),
        ("first_half", "megatron", spec_dict(2), 2, {"save_to": ckpt}),
        ("resumed", "megatron", spec_dict(2), 2, {"load": ckpt}),
    ])


def assert_close_weights(a: dict, b: dict, atol: float = WEIGHT_ATOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


def test_grpo_parity_with_dtensor(world1):
    ref, meg = world1["dtensor"], world1["megatron"]
    assert len(meg["losses"]) == STEPS and meg["version"] == STEPS
    assert meg["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL)
    for key in ("loss/kl", "policy/entropy", "policy/ratio_mean", "policy/is_weight_mean", "policy/grad_norm",
                "policy/lr"):
        assert [m[key] for m in meg["metrics"]] == pytest.approx([m[key] for m in ref["metrics"]], rel=1e-4), key
    assert len({m["policy/lr"] for m in meg["metrics"]}) >= 3  # warm-up, then cosine decay
    assert_close_weights(ref["weights"], meg["weights"])


def test_sft_and_lr_override_parity_with_dtensor(world1):
    ref, meg = world1["dtensor_sft_lr"], world1["megatron_sft_lr"]
    assert meg["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL)
    assert [m["policy/lr"] for m in meg["metrics"]] == pytest.approx([m["policy/lr"] for m in ref["metrics"]])
    assert meg["metrics"][1]["policy/lr"] == 3e-4
    assert_close_weights(ref["weights"], meg["weights"])


def test_export_names_and_shapes_are_the_checkpoints(world1):
    for run, preset in (("megatron", "tiny"), ("moe", "moe-tiny")):
        specs = checkpoint_specs(resolve_model(f"preset:{preset}"))
        weights = world1[run]["weights"]
        assert sorted(weights) == sorted(specs) and len(world1[run]["names"]) == len(specs), run
        for name, tensor in weights.items():
            assert tuple(tensor.shape) == specs[name].shape, name


def test_packed_matches_padded(world1, world2):
    # Packed rows: "thd" PackedSeqParams, RoPE per sequence, per-sequence attention without a mask
    # (the CPU fallback of rlserve.training.attention); with PP=2 every micro-batch of a minibatch
    # is padded to one shape; with TP=2 the logprobs are vocab-parallel over the scored rows.
    for packed in (world1["packed"], world2[0]["pp2_packed"], world2[0]["tp2_packed"]):
        assert packed["losses"] == pytest.approx(world1["megatron"]["losses"], abs=LOSS_ATOL)
        assert_close_weights(world1["megatron"]["weights"], packed["weights"])


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_two_ranks_match_one(world1, world2, layout):
    rank0, rank1 = world2[0][layout], world2[1][layout]
    expected = {"dp2": "tp=1 pp=1", "tp2": "tp=2 pp=1", "pp2": "tp=1 pp=2"}[layout]
    assert rank0["layout"].startswith(expected)
    assert rank0["losses"] == pytest.approx(world1["megatron"]["losses"], abs=LOSS_ATOL)
    for key in ("policy/grad_norm", "policy/entropy"):  # the grad norm counts every TP/PP shard once
        assert [m[key] for m in rank0["metrics"]] == pytest.approx(
            [m[key] for m in world1["megatron"]["metrics"]], rel=1e-4), key
    assert rank0["losses"] == rank1["losses"]  # every rank reports the same metrics
    assert rank1["names"] == rank0["names"]  # every rank walks the same export stream
    assert_close_weights(world1["megatron"]["weights"], rank0["weights"])


def test_moe_trains_and_exports_with_expert_parallelism(world1, world2):
    ep1, ep2 = world1["moe"], world2[0]["moe_ep2"]
    assert "ep=2" in ep2["layout"] and ep1["version"] == 2
    assert all(torch.isfinite(torch.tensor(ep1["losses"])))
    assert ep2["losses"] == pytest.approx(ep1["losses"], abs=LOSS_ATOL)
    assert_close_weights(ep1["weights"], ep2["weights"])
    initial = checkpoint_specs(resolve_model("preset:moe-tiny"))
    assert sorted(ep2["weights"]) == sorted(initial)


def test_save_load_continue_is_bit_identical(world2):
    full, resumed = world2[0]["full"], world2[0]["resumed"]
    assert resumed["version"] == 4
    assert resumed["losses"] == full["losses"][2:]  # exact equality after the reload
    for name, tensor in full["weights"].items():
        assert torch.equal(tensor, resumed["weights"][name]), name


def test_unknown_passthrough_keys_name_close_matches():
    from rlserve.learner.megatron.config import Passthrough

    cfg = parse_spec(spec_dict(1, recompute_granularty="full", overlap_grad_reduce=True)).policy.megatron_cfg
    with pytest.raises(ValueError, match="recompute_granularty.*did you mean 'recompute_granularity'"):
        Passthrough.from_cfg(cfg)
    cfg = parse_spec(spec_dict(1, optimizer={"adam_eps": 1e-6}, distributed_data_parallel_config={
        "grad_reduce_in_fp32": True}, moe_router_dtype="fp64", overlap_grad_reduce=True)).policy.megatron_cfg
    with pytest.raises(ValueError, match=r"optimizer.adam_eps: set by policy.optimizer.kwargs.eps"):
        Passthrough.from_cfg(cfg)
    cfg = parse_spec(spec_dict(1, distributed_data_parallel_config={"grad_reduce_in_fp32": True},
                               moe_router_dtype="fp64", overlap_grad_reduce=True)).policy.megatron_cfg
    passthrough = Passthrough.from_cfg(cfg)
    assert passthrough.ddp == {"grad_reduce_in_fp32": True, "overlap_grad_reduce": True}
    assert passthrough.transformer == {"moe_router_dtype": "fp64"}
    assert passthrough.optimizer == {}


def test_without_cuda_the_backend_refuses_to_start():
    from rlserve.learner.megatron.backend import MegatronBackend

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    spec = parse_spec(spec_dict(1))
    with pytest.raises(RuntimeError, match="megatron learner backend needs CUDA"):
        MegatronBackend(spec, resolve_model(spec.policy.model_name), torch.device("cpu"))


def test_automatic_layout_grows_model_parallelism_with_the_model():
    from rlserve.config.policy import MegatronCfg
    from rlserve.learner.megatron.parallel_dims import ModelShape, choose_layout

    gib = 2**30
    small = ModelShape(10**9, 0, 16, 2048, 16, 8, 32000, 0)
    layout = choose_layout(MegatronCfg(enabled=True), small, 8, 80 * gib, 4096, "bfloat16", 8)
    assert (layout.tp, layout.pp, layout.dp) == (1, 1, 8) and "fits" in layout.reason
    big = ModelShape(70 * 10**9, 0, 80, 8192, 64, 8, 128256, 0)
    layout = choose_layout(MegatronCfg(enabled=True), big, 16, 141 * gib, 4096, "bfloat16", 8)
    assert layout.tp == 8 and layout.pp == 2 and layout.dp == 1, layout.describe()
    moe = ModelShape(10**9, 6 * 10**8, 16, 2048, 16, 8, 32000, 8)
    layout = choose_layout(MegatronCfg(enabled=True, tensor_model_parallel_size=2), moe, 8, 80 * gib, 4096,
                           "bfloat16", 8)
    assert (layout.tp, layout.ep, layout.etp, layout.dp) == (2, 4, 2, 4), layout.describe()
    layout = choose_layout(MegatronCfg(enabled=True, sequence_parallel=True), small, 2, 80 * gib, 4096,
                           "bfloat16", 8)
    assert not layout.sequence_parallel and "sequence_parallel off" in layout.reason
