"""Tiny random models of the architectures people fine-tune, built from transformers config classes.

One entry per architecture (or variant that takes its own code path): tied and
untied Llama 3 (several EOS ids, llama3 RoPE scaling), Qwen2 (q/k/v biases),
Qwen3 (q/k norms, heads * head_dim != hidden), Qwen3-MoE and Mixtral
(transformers 5 fuses their experts in memory; the checkpoint keeps them one
by one), Mistral with and without a sliding window, Gemma2 (final-logit and
attention soft-capping, sandwich norms, scaled embeddings), Gemma3 text (q/k
norms, local/global RoPE) and Phi3 (fused qkv_proj and gate_up_proj).

Sizes keep every engine on its fast path: head_dim 32 (vLLM's CPU attention
wants multiples of 32), hidden and expert FFN widths multiples of 32 (vLLM's
CPU MoE kernel). Soft-capping values are small, and a sliding window of 8
shorter than the test sequences, so that skipping either shows up as a large
logprob error. Norm weights and biases are randomised (HF initialises them to
constants, which would hide a layout mistake).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers

from rlserve.models.tokenizer import BOS, EOS, PAD, save_tokenizer, token_id, vocab_size

SMALL = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6)
WINDOW = 8  # shorter than the test sequences: a skipped window changes the numbers

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, eos_token_id=[token_id(EOS), token_id("!")], max_position_embeddings=16384,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=8, tie_word_embeddings=False)),  # 8 * 32 != hidden
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=1.0, attn_logit_softcapping=1.0, query_pre_attn_scalar=1,
                                    sliding_window=WINDOW, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=32, sliding_window=WINDOW, final_logit_softcapping=2.0,
                                        layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=token_id(PAD))),
}


def hf_config(name: str):
    cls_name, extra = ARCHITECTURES[name]
    kwargs = dict(SMALL, vocab_size=vocab_size(), bos_token_id=token_id(BOS), eos_token_id=token_id(EOS),
                  pad_token_id=token_id(PAD), dtype="float32")
    kwargs.update(extra)
    return getattr(transformers, cls_name)(**kwargs)


def _randomise_constants(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases start as constants in HF; make their layout visible."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def make_architecture(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A random tiny model of `name` saved as an HF folder (safetensors, tokenizer, generation config)."""
    config = hf_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_constants(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(out_dir, model_max_length=config.max_position_embeddings)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "pad_token_id": config.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


@functools.cache
def architecture_dir(name: str, root: str) -> Path:
    """The model folder for `name` under `root`, made once per process."""
    path = Path(root) / name
    return path if (path / "config.json").is_file() else make_architecture(name, path)


# Token sequences every architecture is scored on: longer than WINDOW, of unequal lengths (padding),
# with completions of several tokens. (prompt length, total length) per sequence.
SHAPES = ((6, 20), (4, 16), (9, 12))


def sequences(seed: int = 5) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of the scored sequences, ids among the ordinary symbols."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(4, vocab_size(), (n,), generator=g).tolist(), p) for p, n in SHAPES]


def _eager(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@torch.no_grad()
def transformers_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of the model's own ForCausalLM forward (eager attention)."""
    return _eager(path)(input_ids=torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def transformers_logprobs(path: Path, seqs: list[tuple[list[int], int]]) -> list[list[float]]:
    """Completion-token logprobs from the model's own ForCausalLM forward, one sequence at a time.

    Eager attention: the reference implementation of every architecture (transformers' SDPA
    path drops Gemma2's attention soft-capping).
    """
    model = _eager(path)
    out = []
    for ids, p in seqs:
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = logits.log_softmax(-1)
        out.append([float(logp[t - 1, ids[t]]) for t in range(p, len(ids))])
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def learner_spec(tp: int = 1, sp: bool = False) -> dict:
    return {"policy": {"dtensor_cfg": {"tensor_parallel_size": tp, "sequence_parallel": sp},
                       "train_micro_batch_size": 4, "max_total_sequence_length": 32,
                       "generation": {"max_new_tokens": 8}},
            "cluster": {"num_workers": tp},
            "loss_fn": {"reference_policy_kl_penalty": 0.05}}


@torch.no_grad()
def _learner_logprobs(backend, batch, packed: bool) -> list[list[float]]:
    """The learner's completion logprobs of every sequence of `batch`, in one micro-batch."""
    from rlserve.training.batch import rank_micro_batches

    (mb,) = rank_micro_batches(batch, list(range(batch.num_seqs)), 0, 1, packed=packed, micro_batch_size=8,
                               mb_tokens=64, algorithm="balanced", pad_id=backend.pad_id)
    flat = backend.model(mb, with_entropy=False)[0].tolist()
    cuts = [0] + batch.completion_lens.cumsum(0).tolist()
    return [flat[a:b] for a, b in zip(cuts, cuts[1:])]


def dtensor_runs(rank: int, world: int, names: list[str], root: str, tp: int, sp: bool, export: bool) -> dict:
    """For each architecture, on `world` gloo ranks: learner logprobs (padded and packed) of
    `sequences()`, one GRPO step, logprobs after it and (rank 0, `export`) the exported weights
    written as an HF folder `<root>/<name>-step`."""
    from rlserve.config import parse_spec
    from rlserve.learner.dtensor.backend import DTensorBackend
    from rlserve.models.hf_io import write_hf_folder
    from rlserve.training.batch import TrainBatch
    from tests.support.batches import random_grpo_batch

    seqs = sequences()
    batch = TrainBatch.from_sequences([s for s, _ in seqs], [p for _, p in seqs])
    results = {}
    for name in names:
        path = architecture_dir(name, root)
        backend = DTensorBackend(parse_spec(learner_spec(tp, sp)), path, torch.device("cpu"))
        before = {layout: _learner_logprobs(backend, batch, layout == "packed") for layout in ("padded", "packed")}
        metrics = backend.train_step(random_grpo_batch(1), "grpo").metrics
        exported = {n: t.clone() for n, t in backend.export_weights()}
        if export and rank == 0:
            write_hf_folder(Path(root) / f"{name}-step", exported, path, {"step": 1})
        results[name] = {"before": before, "after": _learner_logprobs(backend, batch, False),
                         "loss": metrics["loss/total"], "grad_norm": metrics["policy/grad_norm"]}
        del backend
    return results
