"""Generated models: deterministic, loadable by transformers, the tokenizer round-trips."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.models import PRESETS, resolve_model
from rlserve.models.factory import hf_config, make_model
from rlserve.models.presets import get_preset


def test_make_model_is_deterministic_in_the_seed(tmp_path):
    a = make_model(get_preset("tiny"), tmp_path / "a", seed=3)
    b = make_model(get_preset("tiny"), tmp_path / "b", seed=3)
    c = make_model(get_preset("tiny"), tmp_path / "c", seed=4)
    ta, tb, tc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.norm.weight"] + ta["model.embed_tokens.weight"].sum(),
                           tc["model.norm.weight"] + tc["model.embed_tokens.weight"].sum())


def test_presets_have_the_promised_sizes():
    def params(name):
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(get_preset(name))).parameters())
    assert 0.5e6 < params("tiny") < 2e6
    assert 20e6 < params("small") < 50e6
    assert 0.85e9 < params("1b") < 0.95e9
    assert get_preset("moe-tiny").num_experts == 4 and get_preset("moe-tiny").experts_per_token == 2
    assert {"tiny", "small", "1b", "moe-tiny"} <= set(PRESETS)


def test_transformers_loads_the_folder_and_tokenizer_round_trips():
    path = resolve_model("preset:tiny")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("47+85=", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tok.decode(ids) == "47+85="
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.bos_token_id is not None
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model(torch.tensor([ids])).logits.shape[-1] == model.config.vocab_size


def test_resolve_model_rejects_non_model_folders(tmp_path):
    with pytest.raises(ValueError, match="not an HF model folder"):
        resolve_model(str(tmp_path))
