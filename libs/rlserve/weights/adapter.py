"""The interchange layout of a LoRA adapter: a PEFT adapter folder.

A folder of `adapter_config.json` (rank, alpha, target modules) and
`adapter_model.safetensors` with tensors `base_model.model.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r] for each adapted linear layer `<module>`
of the base model. The learner exports it, the weight store holds it, the
rollout engines (vLLM's LoRA requests, peft in the transformers engine) load
it, and `peft` reads it. Like full weights, an adapter is checked against the
served base model before any engine sees it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlserve.weights.specs import TensorSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# How PEFT names the tensors of a saved adapter: this prefix, then the module's path in the model.
PEFT_PREFIX = "base_model.model."


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_name(param_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` (peft's parameter) -> its saved name."""
    return PEFT_PREFIX + param_name.replace(".default.", ".")


def param_name(saved: str, adapter_name: str = "default") -> str:
    """The inverse of `peft_name` (the parameter of peft's adapter `adapter_name`)."""
    module, _, kind = saved.removeprefix(PEFT_PREFIX).rpartition(".lora_")
    return f"{module}.lora_{kind.replace('.', f'.{adapter_name}.', 1)}"


def adapter_config(rank: int, alpha: float, dropout: float, targets: list[str], base_model: str) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for a LoRA adapter."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True}


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / WEIGHTS_FILE), {"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def read_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    return load_file(str(folder / WEIGHTS_FILE)), json.loads((folder / CONFIG_FILE).read_text())


def is_adapter_folder(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file()


def check_adapter(base: dict[str, TensorSpec], got: dict[str, TensorSpec], config: dict[str, Any]) -> list[str]:
    """Problems with an adapter for the base model `base` (empty list: it fits): every tensor must be
    lora_A [r, in] or lora_B [out, r] of a linear weight [out, in] of the base, in a floating dtype,
    and every module the config targets must have both."""
    problems, rank = [], config.get("r")
    if not isinstance(rank, int) or rank < 1:
        return [f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}"]
    modules: dict[str, set[str]] = {}
    for name, spec in got.items():
        module, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        weight = base.get(f"{module}.weight")
        if not name.startswith(PEFT_PREFIX) or kind not in ("A.weight", "B.weight") or weight is None \
                or len(weight.shape) != 2:
            problems.append(f"{name}: not the adapter of a linear layer of the served model")
            continue
        out, inp = weight.shape
        want = (rank, inp) if kind == "A.weight" else (out, rank)
        if spec.shape != want:
            problems.append(f"{name}: shape {list(spec.shape)} != {list(want)} (rank {rank} on {module})")
        elif not spec.dtype.is_floating_point:
            problems.append(f"{name}: dtype {spec.dtype} is not a floating-point type")
        modules.setdefault(module, set()).add(kind)
    half = sorted(m for m, kinds in modules.items() if len(kinds) != 2)
    if half:
        problems.append(f"{half[0]}: lora_A without lora_B or the reverse")
    targets = set(config.get("target_modules") or [])
    untargeted = sorted(m for m in modules if m.rsplit(".", 1)[-1] not in targets)
    if untargeted:
        problems.append(f"{untargeted[0]}: adapted, but not among the config's target_modules {sorted(targets)}")
    return problems
