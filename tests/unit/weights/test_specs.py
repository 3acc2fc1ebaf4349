"""Update validation against the served checkpoint's layout."""

from __future__ import annotations

import torch

from rlserve.models import resolve_model
from rlserve.weights.specs import TensorSpec, check_update, checkpoint_specs, fingerprint


def test_checkpoint_specs_and_update_checks():
    specs = checkpoint_specs(resolve_model("preset:tiny"))
    assert "model.embed_tokens.weight" in specs and "lm_head.weight" in specs
    assert fingerprint(specs) == fingerprint(dict(reversed(list(specs.items()))))
    good = {n: TensorSpec(s.shape, torch.bfloat16) for n, s in specs.items()}
    assert check_update(specs, good) == []
    name = "model.norm.weight"
    assert "shape" in check_update(specs, {**good, name: TensorSpec((3,), torch.float32)})[0]
    assert "not a parameter" in check_update(specs, {**good, "bogus": TensorSpec((1,), torch.float32)})[0]
    assert "floating" in check_update(specs, {**good, name: TensorSpec(specs[name].shape, torch.int64)})[0]
    missing = dict(good)
    missing.pop(name)
    assert check_update(specs, missing)[0].startswith("missing 1 tensors")
