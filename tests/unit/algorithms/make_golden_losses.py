"""Write `golden_losses.json`: the GRPO and SFT losses' results on fixed float64 inputs.

`golden_losses.json` was generated at commit 3597194 (the single `grpo_loss` /
`sft_loss` of `rlserve/algorithms/losses.py`, before the losses were split into
pieces behind a registry) with

    PYTHONPATH=libs:. python -m tests.unit.algorithms.make_golden_losses

and `test_golden_losses.py` checks that every variant still gives that result:
the loss, each metric sum and the gradient with respect to the current
logprobs. `evaluate` is the one place that calls the losses; it follows their
API (then the two functions, now the registry), the stored numbers do not.
Regenerate only when a loss is meant to change (and say so in the commit).

The inputs are stored in the file too (float64, non-finite values as strings),
so the check depends on no random generator. Masked tokens hold -inf, +inf and
NaN, as padding and top-k mismatches do; one sequence has no valid token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.registry import make_loss
from rlserve.config.spec import LossFnCfg

GOLDEN = Path(__file__).with_name("golden_losses.json")
F64 = torch.float64

# Name -> loss_fn keys (validated by LossFnCfg). Each runs on every batch of BATCHES.
BETA = {"reference_policy_kl_penalty": 0.1}
SEQ = {"token_level_loss": False}
GSPO = {"sequence_level_importance_ratios": True, "token_level_loss": False}
IS = {"use_importance_sampling_correction": True}
NO_CLAMPS = {"kl_input_clamp_value": None, "kl_output_clamp_value": None}
TIGHT_CLAMPS = {"kl_input_clamp_value": 0.5, "kl_output_clamp_value": 0.3}
GRPO_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "sequence_level": SEQ,
    "clip_higher": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28},
    "clip_higher_sequence_level": {"ratio_clip_min": 0.1, "ratio_clip_max": 0.5, **SEQ},
    "dual_clip": {"ratio_clip_c": 3.0},
    "dual_clip_sequence_level": {"ratio_clip_c": 1.5, **SEQ},
    **{f"kl_{k}": {**BETA, "reference_policy_kl_type": k} for k in ("k1", "k2", "k3")},
    **{f"kl_{k}_no_clamps": {**BETA, "reference_policy_kl_type": k, **NO_CLAMPS} for k in ("k1", "k2", "k3")},
    **{f"kl_{k}_tight_clamps": {**BETA, "reference_policy_kl_type": k, **TIGHT_CLAMPS} for k in ("k1", "k2", "k3")},
    "kl_k3_input_clamp_only": {**BETA, "kl_output_clamp_value": None},
    "kl_k2_output_clamp_only": {**BETA, "reference_policy_kl_type": "k2", "kl_input_clamp_value": None},
    "kl_sequence_level": {**BETA, **SEQ},
    "on_policy_kl_k3": {**BETA, "use_on_policy_kl_approximation": True},
    "on_policy_kl_k1_sequence_level": {**BETA, "reference_policy_kl_type": "k1",
                                       "use_on_policy_kl_approximation": True, **SEQ},
    "is_tis": {**IS, "truncated_importance_sampling_ratio": 2.0},
    "is_tis_tight": {**IS, "truncated_importance_sampling_ratio": 1.2},
    "is_untruncated": {**IS, "truncated_importance_sampling_ratio": None},
    "is_icepop": {**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 2.0},
    "is_icepop_ratio_min": {**IS, "truncated_importance_sampling_type": "icepop",
                            "truncated_importance_sampling_ratio": 1.5,
                            "truncated_importance_sampling_ratio_min": 0.8},
    "is_tis_sequence_level": {**IS, "truncated_importance_sampling_ratio": 1.5, **SEQ},
    "gspo": GSPO,
    "gspo_tis_kl_dual_clip": {**GSPO, **IS, **BETA, "truncated_importance_sampling_ratio": 1.5, "ratio_clip_c": 2.0},
    "gspo_icepop_ratio_min": {**GSPO, **IS, "truncated_importance_sampling_type": "icepop",
                              "truncated_importance_sampling_ratio": 1.3,
                              "truncated_importance_sampling_ratio_min": 0.9},
    "all_on_token_level": {"reference_policy_kl_penalty": 0.3, "ratio_clip_c": 2.0, **IS,
                           "truncated_importance_sampling_ratio": 1.5, "use_on_policy_kl_approximation": True,
                           "kl_input_clamp_value": 1.0, "kl_output_clamp_value": 0.8},
}
# Variants of how the loss is called rather than configured.
CALLS: dict[str, dict[str, Any]] = {
    # A step of one optimizer update passes curr.detach() as prev (training/objective.py).
    "prev_is_curr_kl_k3": {"cfg": {**BETA, **IS}, "prev_is_curr": True},
    # beta = 0: reference logprobs, if any, do not count.
    "zero_beta_with_reference": {"cfg": {}, "with_reference": True},
    # A micro-batch is one share of a larger step: the normaliser counts the whole step.
    "global_normalizer": {"cfg": {**BETA, **IS}, "normalizer": 50.0},
    "global_normalizer_sequence_level": {"cfg": {**BETA, **SEQ}, "normalizer": 9.0},
}
SFT_CALLS: dict[str, dict[str, Any]] = {"sft": {}, "sft_global_normalizer": {"normalizer": 50.0}}


def _batch(seed: int, lengths: list[int], spread: float) -> dict[str, list]:
    """Flat token vectors of len(lengths) sequences; sequence 1 has no valid token when there are 3+."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    seq_index = [s for s, length in enumerate(lengths) for _ in range(length)]
    mask = (torch.rand(n, generator=g) > 0.25).to(F64)
    if len(lengths) >= 3:
        mask[torch.tensor(seq_index) == 1] = 0.0
    curr = -torch.rand(n, generator=g, dtype=F64) * 3
    prev = curr + spread * torch.randn(n, generator=g, dtype=F64)
    gen = prev + spread * torch.randn(n, generator=g, dtype=F64)
    ref = curr + torch.randn(n, generator=g, dtype=F64)
    # A few reference logprobs far off, past the KL's input (20) and output (10) clamps.
    far = torch.randperm(n, generator=g)[:3]
    ref[far] = curr[far] + torch.tensor([-25.0, 25.0, -12.0], dtype=F64)
    adv = (2 * torch.randn(len(lengths), generator=g, dtype=F64))[torch.tensor(seq_index)]
    # What padding and top-k mismatches leave in masked tokens.
    garbage = [float("-inf"), float("nan"), float("inf")]
    for i in (mask == 0).nonzero().squeeze(-1).tolist():
        curr[i], prev[i], gen[i], ref[i], adv[i] = (garbage[(i + k) % 3] for k in range(5))
    return {"curr": curr.tolist(), "prev": prev.tolist(), "gen": gen.tolist(), "ref": ref.tolist(),
            "adv": adv.tolist(), "mask": mask.tolist(), "seq_index": seq_index}


BATCHES = {
    "mixed_lengths": lambda: _batch(0, [3, 4, 1, 7, 2, 5], spread=0.4),
    "long_wide_ratios": lambda: _batch(1, [12, 9, 15, 6], spread=1.0),
}


def _natural_normalizer(batch: dict[str, list], token_level: bool) -> float:
    """The step's valid tokens (token level) or sequences (sequence level), as training/objective.py counts."""
    if token_level:
        return float(max(1.0, sum(batch["mask"])))
    return float(max(batch["seq_index"]) + 1)


def evaluate(kind: str, call: dict[str, Any], batch: dict[str, list]) -> dict[str, Any]:
    """Loss, metric sums and d loss / d curr of one case (a registered loss name) on one batch."""
    t = {k: torch.tensor(v, dtype=F64) for k, v in batch.items() if k != "seq_index"}
    seq_index = torch.tensor(batch["seq_index"])
    curr = t["curr"].clone().requires_grad_(True)
    loss_fn = make_loss(kind, LossFnCfg(**call.get("cfg", {})))
    inputs = LossInputs(
        curr_logprobs=curr, prev_logprobs=curr.detach() if call.get("prev_is_curr") else t["prev"],
        gen_logprobs=t["gen"], ref_logprobs=t["ref"] if loss_fn.needs_reference_logprobs or call.get(
            "with_reference") else None,
        advantages=t["adv"], mask=t["mask"], seq_index=seq_index, num_seqs=int(seq_index.max()) + 1)
    loss, metrics = loss_fn(inputs, call["normalizer"])
    loss.backward()
    return {"loss": loss.item(), "grad": curr.grad.tolist(), "metrics": {k: v.item() for k, v in metrics.items()}}


def cases(batch: dict[str, list]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Case name -> (loss kind, call), each call with its normaliser."""
    out: dict[str, tuple[str, dict[str, Any]]] = {name: ("grpo", {"cfg": cfg}) for name, cfg in GRPO_VARIANTS.items()}
    out |= {name: ("grpo", dict(call)) for name, call in CALLS.items()}
    out |= {name: ("sft", dict(call)) for name, call in SFT_CALLS.items()}
    for kind, call in out.values():
        token_level = make_loss(kind, LossFnCfg(**call.get("cfg", {}))).token_level
        call.setdefault("normalizer", _natural_normalizer(batch, token_level))
    return out


def encode(x: Any) -> Any:
    """JSON has no NaN or infinity: store them as the strings float() reads back."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {k: encode(v) for k, v in x.items()}
    return x


def decode(x: Any) -> Any:
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        return {k: decode(v) for k, v in x.items()}
    return x


def load_golden() -> dict[str, Any]:
    return decode(json.loads(GOLDEN.read_text()))


def _section(entries: dict[str, Any]) -> str:
    """One JSON line per entry, so that a diff of the file shows which cases changed."""
    return "{\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(encode(v), allow_nan=False)}"
                              for k, v in entries.items()) + "\n  }"


def main() -> None:
    batches = {name: make() for name, make in BATCHES.items()}
    results = {f"{name}/{batch_name}": {"kind": kind, "call": call, "batch": batch_name,
                                        **evaluate(kind, call, batch)}
               for batch_name, batch in batches.items() for name, (kind, call) in cases(batch).items()}
    GOLDEN.write_text(f'{{\n  "batches": {_section(batches)},\n  "cases": {_section(results)}\n}}\n')
    print(f"wrote {len(results)} cases to {GOLDEN}")


if __name__ == "__main__":
    main()
