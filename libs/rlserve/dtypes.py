"""Tensor dtypes by name: the one map from the spec's and the cluster file's names, and from safetensors codes.

The spec says `precision: bfloat16`, an engine's args `dtype: float16`, a
safetensors header `"dtype": "BF16"`; every module that turns such a name into
a torch dtype asks here, and an unknown name fails with the list of valid ones.
"""

from __future__ import annotations

import torch

# The precisions a run can train, generate or score in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# safetensors header codes (what a checkpoint may hold, not only floats).
SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    """The dtype a precision name ("float32", "bfloat16", "float16") names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def safetensors_dtype(code: str) -> torch.dtype:
    """The dtype a safetensors header code ("F32", "BF16", ...) names."""
    try:
        return SAFETENSORS_DTYPES[code]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {code!r}; valid: {', '.join(SAFETENSORS_DTYPES)}") from None
