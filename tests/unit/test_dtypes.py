"""Dtype names: the spec's precisions and safetensors codes, with a clear error for anything else."""

from __future__ import annotations

import pytest
import torch

from rlserve.dtypes import safetensors_dtype, torch_dtype


def test_precision_names():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; valid: float32, bfloat16, float16"):
        torch_dtype("fp8")


def test_safetensors_codes():
    assert safetensors_dtype("BF16") is torch.bfloat16 and safetensors_dtype("BOOL") is torch.bool
    with pytest.raises(ValueError, match="unknown safetensors dtype 'F8_E4M3'"):
        safetensors_dtype("F8_E4M3")
