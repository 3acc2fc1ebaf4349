"""Generated models: deterministic, loadable by transformers, the tokenizer round-trips."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlserve.models import PRESETS, resolve_model
from rlserve.models.bpe import build_bpe_tokenizer
from rlserve.models.factory import hf_config, make_model
from rlserve.models.hf_io import write_hf_folder
from rlserve.models.presets import get_preset
from rlserve.models.tokenizer import special_ids


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
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(get_preset(name), special_ids())).parameters())
    assert 0.5e6 < params("tiny") < 2e6
    assert 20e6 < params("small") < 50e6
    assert 0.85e9 < params("1b") < 0.95e9
    assert get_preset("moe-tiny").num_experts == 4 and get_preset("moe-tiny").experts_per_token == 2
    assert {"tiny", "small", "1b", "moe-tiny", "tiny-chat"} <= set(PRESETS)


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


def test_the_chat_preset_has_a_bpe_tokenizer_a_chat_template_and_two_eos_ids():
    path = resolve_model("preset:tiny-chat")
    tok = AutoTokenizer.from_pretrained(path)
    text = "What is the answer? 47+85="
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges: fewer tokens than characters
    assert all(len(tok.decode([i])) == 1 for i in tok("47+85=", add_special_tokens=False).input_ids)  # digit by digit
    assert tok.decode(tok("naïve – ok", add_special_tokens=False).input_ids) == "naïve – ok"  # byte level: no unknowns
    assert tok.chat_template and (path / "chat_template.jinja").is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end_of_text|>")]
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == config["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tok) and model(torch.tensor([ids])).logits.shape[-1] == len(tok)


def test_the_bpe_tokenizer_is_the_same_on_every_build():
    assert build_bpe_tokenizer().to_str() == build_bpe_tokenizer().to_str()


def test_save_hf_keeps_every_side_file_of_the_input_model(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    side = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "merges.txt", "vocab.json", "tokenizer.model",
            "added_tokens.json", "preprocessor_config.json"]
    weights = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "rlserve_preset.json"]
    for name in side + weights:
        (src / name).write_text(name)
    out = tmp_path / "out"
    write_hf_folder(out, {"w": torch.ones(2)}, src, {"version": 3})
    assert sorted(p.name for p in out.iterdir()) == sorted([*side, "model.safetensors", "rlserve_export.json"])
    assert (out / "chat_template.jinja").read_text() == "chat_template.jinja"
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(2))
