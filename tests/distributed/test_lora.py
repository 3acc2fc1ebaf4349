"""LoRA on the dtensor backend (gloo): only the adapters train and reach the optimizer, the base stays
as it was; with the adapters off the learner computes exactly the base model's (the reference)
logprobs; 2 ranks (FSDP, TP) match 1; save -> load -> continue is bit-identical; the adapter it
exports is a PEFT folder that peft loads to the learner's logprobs, merged or not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlserve.config import parse_spec
from rlserve.models import resolve_model
from tests.support.batches import completion_logprobs, random_grpo_batch, random_grpo_sequences
from tests.support.dist import run_ranks, run_ranks_in_turn

STEPS = 3
RANK = 8


def spec_dict(world: int, tp: int = 1, kl: float = 0.05) -> dict:
    return {"policy": {"dtensor_cfg": {"tensor_parallel_size": tp,
                                       "lora_cfg": {"enabled": True, "dim": RANK, "dropout": 0.0}},
                       "train_global_batch_size": 6, "train_micro_batch_size": 2, "max_total_sequence_length": 32,
                       "generation": {"max_new_tokens": 8}, "optimizer": {"kwargs": {"lr": 1e-2}}},
            "cluster": {"num_workers": world},
            "loss_fn": {"reference_policy_kl_penalty": kl, "use_importance_sampling_correction": True}}


def batch(seed: int):
    """A GRPO batch without reference logprobs: a LoRA learner computes them itself."""
    return replace(random_grpo_batch(seed), ref_logprobs=None)


def backend(spec: dict, init_adapter: str | None = None):
    from rlserve.learner.dtensor.backend import DTensorBackend

    return DTensorBackend(parse_spec(spec), resolve_model("preset:tiny"), torch.device("cpu"),
                          Path(init_adapter) if init_adapter else None)


def train(rank: int, world: int, spec: dict, steps: int, save_to: str | None = None, load: str | None = None,
          snapshot: bool = False):
    """`steps` steps, after loading a checkpoint (or a snapshot) from `load`, before saving one to `save_to`."""
    b = backend(spec)
    if load:
        (b.load_snapshot if snapshot else b.load_checkpoint)(Path(load))
    losses = [b.train_step(batch(b.version), "grpo").metrics["loss/total"] for _ in range(steps)]
    if save_to:
        (b.save_snapshot if snapshot else b.save_checkpoint)(Path(save_to))
    adapter = {n: t.clone() for n, t in b.export_weights()}
    return losses, (adapter if rank == 0 else None), b.version


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Where the shared spawns save: `ckpt` (a checkpoint, 1 rank), `snap1` and `snap2` (snapshots, 1 and 2
    ranks), after 2 steps each, and `adapter` (the exported PEFT folder); fresh processes load them."""
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def runs(saved) -> dict[str, list]:
    """Per-rank results of the module's runs that load nothing, those of one world size in one spawn
    (`run_ranks_in_turn`): the reference (1 rank), FSDP and TP on 2, 4 uninterrupted steps on 1 and 2, the
    runs that save after 2 steps, two runs on one base on 1 and 2, the adapters-only checks, the export."""
    one, two = spec_dict(1), spec_dict(2)
    out = run_ranks_in_turn(1, {
        "reference": (train, one, STEPS), "uninterrupted": (train, one, 4),
        "ckpt": (train, one, 2, str(saved / "ckpt")), "snap1": (train, one, 2, str(saved / "snap1"), None, True),
        "sharing": (two_runs_on_one_base, one, STEPS), "adapters": (adapters_and_reference,),
        "export": (export_and_restart, str(saved / "adapter"))})
    out.update({f"{name}2": results for name, results in run_ranks_in_turn(2, {
        "fsdp": (train, two, STEPS), "tp": (train, spec_dict(2, tp=2), STEPS), "uninterrupted": (train, two, 4),
        "snap": (train, two, 2, str(saved / "snap2"), None, True), "sharing": (two_runs_on_one_base, two, STEPS),
    }).items()})
    return out


@pytest.fixture(scope="module")
def reference_run(runs):
    return runs["reference"][0]


def adapters_and_reference(rank, world):
    from rlserve.reference.scorer import ReferenceScorer, Sequence
    from rlserve.training.objective import StepObjective
    from rlserve.weights import adapter

    b = backend(spec_dict(1))
    base = {n: p.detach().clone() for n, p in b.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in b.model.named_parameters() if p.requires_grad}
    for step in range(2):
        b.train_step(batch(step), "grpo")
    frozen_same = all(torch.equal(p, base[n]) for n, p in b.model.named_parameters() if n in base)
    moved = sum(not torch.equal(p, adapters[n]) for n, p in b.model.named_parameters() if n in adapters)
    optimizer_params = sum(1 for _ in b.optimizer.state)
    # The reference pass: the learner with its adapters off against a separately loaded base model.
    probe = random_grpo_batch(7)
    objective = StepObjective(b.spec, replace(probe, ref_logprobs=None), "grpo", 1, 0, b.pad_id)
    with torch.no_grad():
        off = torch.cat([lp for plan in b._reference_logprobs(objective) for lp in plan])
        on = torch.cat([b.model(mb, with_entropy=False)[0] for plan in objective.plans for mb in plan])
    ids, prompts, *_ = random_grpo_sequences(7)
    scorer = ReferenceScorer(resolve_model("preset:tiny"))
    base_lps = torch.tensor([x for lp in scorer.logprobs([Sequence(s, p) for s, p in zip(ids, prompts)])
                             for x in lp])
    names = [n for n, _ in b.export_weights()]
    return (frozen_same, moved, len(adapters), optimizer_params, (off - base_lps).abs().max().item(),
            (on - base_lps).abs().max().item(), names, b.adapter_config, adapter.PEFT_PREFIX)



def test_only_the_adapters_train_and_the_reference_is_the_base(runs):
    (frozen_same, moved, n_adapters, optimizer_params, off_err, on_err, names, adapter, prefix), = runs["adapters"]
    assert frozen_same and moved == n_adapters and optimizer_params == n_adapters
    assert off_err < 1e-4 < on_err  # adapters off: the base model; on: a different policy
    assert adapter["r"] == RANK and sorted(adapter["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert len(names) == n_adapters and all(n.startswith(prefix) and ".lora_" in n for n in names)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_two_ranks_match_one(runs, reference_run, layout):
    results = runs[layout]
    losses, adapter, _ = results[0]
    assert losses == pytest.approx(reference_run[0], abs=2e-5)
    # Adam turns gradients near zero (every A at the first step, when B = 0) into full-size updates
    # of their rounding noise, so the adapters agree less closely than the losses.
    for name, tensor in reference_run[1].items():
        torch.testing.assert_close(adapter[name], tensor, atol=1e-4, rtol=1e-3, msg=name)


def test_save_load_continue_is_bit_identical(runs, saved):
    """A checkpoint saved after 2 steps, loaded by a new process, continues as the uninterrupted run did."""
    (full,) = runs["uninterrupted"]
    (resumed,) = run_ranks(1, train, spec_dict(1), 2, None, str(saved / "ckpt"))
    assert runs["ckpt"][0][2] == 2 and resumed[2] == 4 and resumed[0] == full[0][2:]
    for name, tensor in full[1].items():
        assert torch.equal(tensor, resumed[1][name]), name
    # The checkpoint holds adapters and their optimizer state, not the base.
    size = sum(f.stat().st_size for f in (saved / "ckpt").rglob("*") if f.is_file())
    model = sum(f.stat().st_size for f in resolve_model("preset:tiny").glob("*.safetensors"))
    assert size < model


@pytest.mark.parametrize("world", [1, 2])
def test_a_snapshot_restores_into_new_workers_bit_identically(runs, saved, world):
    """What a learner healing a shared group does: new processes, the run configured again, its snapshot
    loaded (FSDP shards with 2 ranks), and training goes on as if nothing happened."""
    full = runs["uninterrupted" if world == 1 else "uninterrupted2"][0]
    snap = saved / f"snap{world}"
    resumed = run_ranks(world, train, spec_dict(world), 2, None, str(snap), True)[0]
    assert runs[f"snap{world}"][0][2] == 2
    assert resumed[2] == 4 and resumed[0] == full[0][2:]
    for name, tensor in full[1].items():
        assert torch.equal(tensor, resumed[1][name]), name
    assert sorted(f.name for f in snap.iterdir()) == sorted(
        f"snapshot_rank{r}{end}" for r in range(world) for end in (".pt", ".float32.bin"))


def export_and_restart(rank, world, folder):
    b = backend(spec_dict(1))
    for step in range(2):
        b.train_step(batch(step), "grpo")
    b.save_hf(Path(folder))
    from rlserve.training.objective import StepObjective

    probe = random_grpo_batch(9)
    objective = StepObjective(b.spec, probe, "grpo", 1, 0, b.pad_id)
    with torch.no_grad():
        learner = torch.cat([b.model(mb, with_entropy=False)[0] for plan in objective.plans for mb in plan])
    restarted = backend(spec_dict(1), init_adapter=folder)
    with torch.no_grad():
        again = torch.cat([restarted.model(mb, with_entropy=False)[0] for plan in objective.plans for mb in plan])
    return learner, again



def test_the_exported_adapter_loads_in_peft_and_merges(runs, saved):
    learner, again = runs["export"][0]
    torch.testing.assert_close(again, learner, atol=1e-6, rtol=0)  # a new session starts from the adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    seqs, prompts, *_ = random_grpo_sequences(9)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("preset:tiny"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, saved / "adapter").eval()
    torch.testing.assert_close(completion_logprobs(peft_model, seqs, prompts), learner, atol=1e-4, rtol=0)
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(completion_logprobs(merged, seqs, prompts), learner, atol=1e-4, rtol=0)


def two_runs_on_one_base(rank: int, world: int, spec: dict, steps: int):
    """Runs A (this file's spec) and B (another rank and targets) share one frozen base and train in turns."""
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.learner.shared_base import SharedBases

    bases, key = SharedBases(), ("tiny", "float32", "cpu")
    other = {**spec, "policy": {**spec["policy"], "dtensor_cfg": {**spec["policy"]["dtensor_cfg"], "lora_cfg": {
        "enabled": True, "dim": 4, "target_modules": ["q_proj", "v_proj"]}}}}
    a = DTensorBackend(parse_spec(spec), resolve_model("preset:tiny"), torch.device("cpu"), None,
                       bases.for_run(key, "a"))
    b = DTensorBackend(parse_spec(other), resolve_model("preset:tiny"), torch.device("cpu"), None,
                       bases.for_run(key, "b"))
    frozen = {n.replace(".base_layer.", "."): p for n, p in a.model.named_parameters() if not p.requires_grad}
    shared = all(p is frozen[n.replace(".base_layer.", ".")] for n, p in b.model.named_parameters()
                 if not p.requires_grad)
    before = {n: p.detach().clone() for n, p in frozen.items()}
    losses = []
    for step in range(steps):
        losses.append(a.train_step(batch(step), "grpo").metrics["loss/total"])
        b.train_step(batch(100 + step), "grpo")
    unchanged = all(torch.equal(p, before[n]) for n, p in frozen.items())
    adapter = {n: t.clone() for n, t in a.export_weights()}
    bases.release("a")
    runs_left = bases.runs(key)
    return losses, (adapter if rank == 0 else None), shared, b.shared_bytes, unchanged, runs_left


@pytest.mark.parametrize("world", [1, 2])
def test_runs_sharing_a_base_train_as_if_alone(runs, reference_run, world):
    """The frozen base is held once (B's frozen parameters are A's, outside FSDP: whole on each rank) and
    stays as it was; A trains as it does alone although B trains between its steps."""
    results = runs["sharing" if world == 1 else "sharing2"]
    losses, adapter, shared, shared_bytes, unchanged, runs_left = results[0]
    assert shared and shared_bytes > 0 and unchanged and runs_left == {"b"}
    assert losses == pytest.approx(reference_run[0], abs=2e-5)
    for name, tensor in reference_run[1].items():
        torch.testing.assert_close(adapter[name], tensor, atol=1e-4, rtol=1e-3, msg=name)
