"""LoRA on the Megatron-Core backend (gloo, CPU, fp32, with the test shim of tests/support/megatron_cpu.py).

- Only the adapters train and reach the optimizer; the base stays as it was; with the adapters
  off the learner computes the base model's logprobs (checked against the reference scorer).
- TP 2, PP 2 and DP 2 match one rank: grad norms to 1e-5 (measured 1e-7), losses to 2e-5,
  adapters to 1e-4 + 1e-3 relative, the tolerances of tests/distributed/test_lora.py (measured:
  1.4e-5 after 6 Adam updates at lr 1e-3). Adam turns gradients near zero into full-size updates of
  their rounding noise: from B = 0 its first update moves every element of B by +-lr, the sign of
  its gradient, so the layouts are compared from a random adapter with B != 0.
  Full activation recompute changes nothing (the frozen embedding's output is made to require grad).
- Save -> load -> continue is bit-identical (TP 2); the checkpoint holds adapters, not the base.
- The exported adapter is a PEFT folder: peft loads it onto the HF base to the learner's logprobs
  (1e-4), merged or not, and a new backend started from it computes them again; an adapter the
  dtensor backend trained continues here with peft's logprobs.
- From the same adapter, the dtensor and megatron backends train alike, on every layer and on
  q_proj/v_proj only (part of Megatron's fused linear_qkv, also under TP 2), to the same tolerances.
- Phi3 (HF's own fused qkv_proj and gate_up_proj) at TP 2 from a peft-written adapter computes
  peft's logprobs; an MoE model adapts its attention under expert parallelism.

Each spawned world runs its scenarios in a row (the backend re-creates Megatron's parallel state).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from rlserve.config import parse_spec
from rlserve.models import resolve_model
from rlserve.weights import adapter
from tests.support.batches import completion_logprobs, random_grpo_batch, random_grpo_sequences
from tests.support.dist import run_ranks

STEPS = 3
RANK = 8
LR = 1e-3
# Adam turns gradients near zero into full-size updates of their rounding noise; the adapters are
# compared after 6 updates, from an adapter with B != 0 (module docstring).
LOSS_ATOL, ADAPTER_ATOL, ADAPTER_RTOL = 2e-5, 1e-4, 1e-3
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QV = ["q_proj", "v_proj"]  # Hu et al.'s choice: part of Megatron's fused linear_qkv
PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # HF fuses q/k/v and gate/up too
PROBE = 9


def spec_dict(world: int, backend: str = "megatron", targets: list[str] | None = None, model: str = "preset:tiny",
              **megatron) -> dict:
    lora = {"enabled": True, "dim": RANK, "dropout": 0.0}
    if targets:
        lora["target_modules"] = targets
    policy = {"model_name": model, "train_global_batch_size": 6, "train_micro_batch_size": 2,
              "max_total_sequence_length": 32, "generation": {"max_new_tokens": 8},
              "optimizer": {"kwargs": {"lr": LR}}}
    if backend == "megatron":
        policy["megatron_cfg"] = {"enabled": True, "peft": lora, **megatron}
    else:
        policy["dtensor_cfg"] = {"lora_cfg": lora}
    return {"policy": policy, "cluster": {"num_workers": world},
            "loss_fn": {"reference_policy_kl_penalty": 0.05, "use_importance_sampling_correction": True}}


def batch(seed: int):
    """A GRPO batch without reference logprobs: a LoRA learner computes them itself."""
    return replace(random_grpo_batch(seed), ref_logprobs=None)


def make(spec: dict, init_adapter: str | None = None):
    from rlserve.learner import make_backend

    parsed = parse_spec(spec)
    return make_backend(parsed, resolve_model(parsed.policy.model_name), torch.device("cpu"),
                        Path(init_adapter) if init_adapter else None)


def probe_logprobs(backend, reference: bool = False) -> torch.Tensor | None:
    """The megatron learner's logprobs of the probe sequences (adapters off with `reference`), last stage only."""
    from rlserve.training.objective import StepObjective

    objective = StepObjective(backend.spec, batch(PROBE), "grpo", backend.dp_size, backend.dp_rank, backend.pad_id)
    with torch.no_grad():
        lps = (backend._reference_logprobs(objective) if reference
               else [backend._forward_logprobs(plan) for plan in objective.plans])
    return torch.cat([lp for plan in lps for lp in plan]) if backend.pp_last else None


def train(rank: int, spec: dict, steps: int, save_to: str | None = None, load: str | None = None,
          init_adapter: str | None = None, export_to: str | None = None) -> dict:
    """Build (from `init_adapter`), optionally load, take `steps` steps, optionally save and write the PEFT folder."""
    try:
        b = make(spec, init_adapter)
    except ValueError as err:
        return {"error": str(err)}
    if load:
        b.load_checkpoint(Path(load))
    metrics = [b.train_step(batch(b.version), "grpo").metrics for _ in range(steps)]
    if save_to:
        b.save_checkpoint(Path(save_to))
    if export_to:
        b.save_hf(Path(export_to))
    exported = list(b.export_weights())
    return {"losses": [m["loss/total"] for m in metrics], "metrics": metrics, "version": b.version,
            "layout": b.info().parallel_layout, "names": [n for n, _ in exported],
            "adapter": {n: t.clone() for n, t in exported} if rank == 0 else None,
            "probe": probe_logprobs(b) if b.name == "megatron" else None}


def inspect(rank: int, spec: dict) -> dict:
    """Two steps, then what changed, what the optimizer holds, and the probe with adapters off and on."""
    b = make(spec)
    before = {n: p.detach().clone() for n, p in b.gpt.named_parameters()}
    trainable = {n for n, p in b.gpt.named_parameters() if p.requires_grad}
    for step in range(2):
        b.train_step(batch(step), "grpo")
    after = dict(b.gpt.named_parameters())
    return {"trainable": sorted(trainable), "frozen_same": all(torch.equal(after[n], t) for n, t in before.items()
                                                               if n not in trainable),
            "moved": sorted(n for n in trainable if not torch.equal(after[n], before[n])),
            "trainable_numel": sum(after[n].numel() for n in trainable),
            "optimizer_numel": sum(p.numel() for g in b.optimizer.param_groups for p in g["params"]),
            "off": probe_logprobs(b, reference=True), "on": probe_logprobs(b), "config": b.adapter_config}


def scenarios(rank: int, world: int, runs: list[tuple[str, str, dict, dict]]) -> dict:
    """Run (name, backend, spec, kwargs) scenarios in a row; kwargs with "steps" go to `train`, else `inspect`."""
    from tests.support.megatron_cpu import megatron_cpu_training

    out = {}
    for name, backend, spec, kwargs in runs:
        run = (lambda: train(rank, spec, **kwargs)) if "steps" in kwargs else (lambda: inspect(rank, spec))
        if backend == "megatron":
            with megatron_cpu_training():
                out[name] = run()
        else:
            out[name] = run()
    return out


def write_initial_adapter(folder: Path, model: Path, targets: list[str]) -> None:
    """A random adapter on `targets`, written by peft (B scaled to a small nonzero size: every part trains)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tuned = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if ".lora_B." in name:
                param.mul_(0.05)
    tuned.save_pretrained(folder)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A folder with a tiny Phi3 and the initial adapters `init_all`, `init_qv` (preset:tiny), `init_phi3`."""
    from tests.support.architectures import make_architecture

    root = tmp_path_factory.mktemp("megatron-lora")
    tiny, phi3 = resolve_model("preset:tiny"), make_architecture("phi3", root / "phi3")
    resolve_model("preset:moe-tiny")
    for name, model, targets in (("init_all", tiny, ALL), ("init_qv", tiny, QV), ("init_phi3", phi3, PHI3)):
        write_initial_adapter(root / name, model, targets)
    return root


@pytest.fixture(scope="module")
def world1(root) -> dict:
    init_all, init_qv = str(root / "init_all"), str(root / "init_qv")
    (result,) = run_ranks(1, scenarios, [
        ("inspect", "megatron", spec_dict(1), {}),
        ("lora", "megatron", spec_dict(1), {"steps": STEPS}),
        ("recompute", "megatron", spec_dict(1, activation_checkpointing=True), {"steps": STEPS}),
        ("dtensor_all", "dtensor", spec_dict(1, "dtensor", ALL),
         {"steps": STEPS, "init_adapter": init_all, "export_to": str(root / "dtensor_trained")}),
        ("megatron_all", "megatron", spec_dict(1, targets=ALL), {"steps": STEPS, "init_adapter": init_all}),
        ("dtensor_qv", "dtensor", spec_dict(1, "dtensor", QV), {"steps": STEPS, "init_adapter": init_qv}),
        ("megatron_qv", "megatron", spec_dict(1, targets=QV), {"steps": STEPS, "init_adapter": init_qv}),
        ("exported", "megatron", spec_dict(1), {"steps": 2, "export_to": str(root / "exported")}),
        ("restarted", "megatron", spec_dict(1), {"steps": 0, "init_adapter": str(root / "exported")}),
        ("from_dtensor", "megatron", spec_dict(1, targets=ALL),
         {"steps": 0, "init_adapter": str(root / "dtensor_trained")}),
    ])
    result["folders"] = {"exported": root / "exported", "dtensor_trained": root / "dtensor_trained"}
    return result


@pytest.fixture(scope="module")
def world2(root) -> list[dict]:
    ckpt, init = str(root / "ckpt"), {"steps": STEPS, "init_adapter": str(root / "init_all")}
    return run_ranks(2, scenarios, [
        ("qv_tp2", "megatron", spec_dict(2, targets=QV, tensor_model_parallel_size=2),
         {"steps": STEPS, "init_adapter": str(root / "init_qv")}),
        ("phi3_tp2", "megatron", spec_dict(2, model=str(root / "phi3"), targets=PHI3, tensor_model_parallel_size=2),
         {"steps": 0, "init_adapter": str(root / "init_phi3")}),
        ("moe_ep2", "megatron", spec_dict(2, model="preset:moe-tiny", expert_model_parallel_size=2), {"steps": 2}),
        ("tp2", "megatron", spec_dict(2, targets=ALL, tensor_model_parallel_size=2), init),
        ("pp2", "megatron", spec_dict(2, targets=ALL, pipeline_model_parallel_size=2), init),
        ("dp2", "megatron", spec_dict(2, targets=ALL, tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
         init),
        ("full", "megatron", spec_dict(2, tensor_model_parallel_size=2), {"steps": 4}),
        ("first_half", "megatron", spec_dict(2, tensor_model_parallel_size=2), {"steps": 2, "save_to": ckpt}),
        ("resumed", "megatron", spec_dict(2, tensor_model_parallel_size=2), {"steps": 2, "load": ckpt}),
    ]) + [ckpt]


def base_logprobs() -> torch.Tensor:
    from rlserve.reference.scorer import ReferenceScorer, Sequence

    seqs, prompts, *_ = random_grpo_sequences(PROBE)
    scorer = ReferenceScorer(resolve_model("preset:tiny"))
    return torch.tensor([x for lp in scorer.logprobs([Sequence(s, p) for s, p in zip(seqs, prompts)]) for x in lp])


def assert_close_adapters(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


def test_only_the_adapters_train_and_the_reference_is_the_base(world1):
    run = world1["inspect"]
    assert run["trainable"] and all(n.endswith((".lora_A", ".lora_B")) for n in run["trainable"])
    assert len(run["trainable"]) == 2 * 4 * 2  # A and B of 4 Megatron layers in each of 2 decoder layers
    assert run["frozen_same"] and run["moved"] == run["trainable"]
    assert run["optimizer_numel"] == run["trainable_numel"]
    base = base_logprobs()
    assert (run["off"] - base).abs().max() < 1e-4 < (run["on"] - base).abs().max()
    assert run["config"]["r"] == RANK and sorted(run["config"]["target_modules"]) == sorted(ALL)
    names = world1["lora"]["names"]
    assert len(names) == 2 * len(ALL) * 2 and all(n.startswith(adapter.PEFT_PREFIX) for n in names)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_two_ranks_match_one(world1, world2, layout):
    one, rank0, rank1 = world1["megatron_all"], world2[0][layout], world2[1][layout]
    expected = {"tp2": "tp=2 pp=1", "pp2": "tp=1 pp=2", "dp2": "tp=1 pp=1 cp=1 ep=1 etp=1 dp=2"}[layout]
    assert rank0["layout"].startswith(expected)
    assert rank0["losses"] == pytest.approx(one["losses"], abs=LOSS_ATOL)
    assert rank0["losses"] == rank1["losses"] and rank0["names"] == rank1["names"] == one["names"]
    # The grad norm counts a replicated adapter once and a TP-split one over its shards.
    assert [m["policy/grad_norm"] for m in rank0["metrics"]] == pytest.approx(
        [m["policy/grad_norm"] for m in one["metrics"]], rel=1e-5)
    assert_close_adapters(one["adapter"], rank0["adapter"], atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)


def test_full_recompute_trains_the_same(world1):
    assert world1["recompute"]["losses"] == pytest.approx(world1["lora"]["losses"], abs=1e-6)
    assert_close_adapters(world1["lora"]["adapter"], world1["recompute"]["adapter"], atol=1e-6, rtol=0)


def test_save_load_continue_is_bit_identical(world2):
    full, resumed, ckpt = world2[0]["full"], world2[0]["resumed"], Path(world2[2])
    assert resumed["version"] == 4 and resumed["losses"] == full["losses"][2:]
    for name, tensor in full["adapter"].items():
        assert torch.equal(tensor, resumed["adapter"][name]), name
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    model = sum(f.stat().st_size for f in resolve_model("preset:tiny").glob("*.safetensors"))
    assert size < model  # adapters and their optimizer state, not the base


def peft_logprobs(folder: Path, merge: bool = False, model: Path | None = None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    seqs, prompts, *_ = random_grpo_sequences(PROBE)
    base = AutoModelForCausalLM.from_pretrained(model or resolve_model("preset:tiny"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    return completion_logprobs(model.merge_and_unload() if merge else model, seqs, prompts)


def test_the_exported_adapter_loads_in_peft_and_merges(world1):
    learner, folder = world1["exported"]["probe"], world1["folders"]["exported"]
    torch.testing.assert_close(world1["restarted"]["probe"], learner, atol=1e-6, rtol=0)
    torch.testing.assert_close(peft_logprobs(folder), learner, atol=1e-4, rtol=0)
    torch.testing.assert_close(peft_logprobs(folder, merge=True), learner, atol=1e-4, rtol=0)


def test_an_adapter_the_dtensor_backend_trained_continues_here(world1):
    folder = world1["folders"]["dtensor_trained"]
    torch.testing.assert_close(world1["from_dtensor"]["probe"], peft_logprobs(folder), atol=1e-4, rtol=0)


def test_fused_hf_modules_and_tensor_parallelism_load_peft_adapters(root, world2):
    # Phi3's qkv_proj ([Q; K; V]) and gate_up_proj are re-fused into Megatron's layout and split over TP.
    torch.testing.assert_close(world2[0]["phi3_tp2"]["probe"], peft_logprobs(root / "init_phi3", model=root / "phi3"),
                               atol=1e-4, rtol=0)


def test_q_and_v_only_train_alike_under_tensor_parallelism(world1, world2):
    one, tp2 = world1["megatron_qv"], world2[0]["qv_tp2"]  # k_proj's rows of linear_qkv take no adapter
    assert tp2["losses"] == pytest.approx(one["losses"], abs=LOSS_ATOL)
    assert sorted({n.split(".")[-3] for n in tp2["adapter"]}) == QV
    assert_close_adapters(one["adapter"], tp2["adapter"], atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)


def test_moe_models_adapt_attention_under_expert_parallelism(world2):
    run = world2[0]["moe_ep2"]
    assert "ep=2" in run["layout"] and all(torch.isfinite(torch.tensor(run["losses"])))
    assert {n.split(".")[-3] for n in run["adapter"]} == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize("targets", ["all", "qv"])
def test_parity_with_dtensor_from_the_same_adapter(world1, targets):
    ref, meg = world1[f"dtensor_{targets}"], world1[f"megatron_{targets}"]
    assert meg["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL)
    assert_close_adapters(ref["adapter"], meg["adapter"], atol=ADAPTER_ATOL, rtol=ADAPTER_RTOL)
