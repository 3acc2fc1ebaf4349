"""Weight buckets and update validation."""

from __future__ import annotations

import torch

from rlserve.models import resolve_model
from rlserve.weights.buckets import iter_buckets, tensor_bytes
from rlserve.weights.specs import TensorSpec, check_update, checkpoint_specs, fingerprint


def test_buckets_are_bounded_and_complete():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(named, max_bytes=160))
    assert [list(b) for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert all(sum(tensor_bytes(t) for t in b.values()) <= 160 or len(b) == 1 for b in buckets)


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
