"""Smoke tests of the `rlserve` console script (as installed), one per subcommand that needs no cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

CLI = str(Path(sys.executable).with_name("rlserve"))


def test_make_model_cli(tmp_path):
    out = subprocess.run([CLI, "make-model", "--preset", "moe-tiny", str(tmp_path / "m")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tmp_path / "m" / name).is_file()
    again = subprocess.run([CLI, "make-model", "--preset", "tiny", str(tmp_path / "m")], capture_output=True, text=True)
    assert again.returncode == 1 and "not empty" in again.stderr


def test_validate_cli(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({"grpo": {"max_num_steps": 3}}))
    bad.write_text(yaml.safe_dump({"grpo": {"max_num_step": 3}}))
    ok = subprocess.run([CLI, "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    fail = subprocess.run([CLI, "validate", str(bad)], capture_output=True, text=True)
    assert fail.returncode == 1
    assert "grpo.max_num_step: unknown key" in fail.stderr


def test_validate_checks_lora_against_a_model_it_can_read(tmp_path):
    def validate(lora: dict) -> subprocess.CompletedProcess:
        path = tmp_path / "lora.yaml"
        path.write_text(yaml.safe_dump({"policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True, **lora}}}}))
        return subprocess.run([CLI, "validate", str(path)], capture_output=True, text=True)

    assert validate({"dim": 16}).returncode == 0
    wide = validate({"dim": 100})
    assert wide.returncode == 1 and "policy.dtensor_cfg.lora_cfg.dim: 100 exceeds the width of k_proj" in wide.stderr
    missing = validate({"target_modules": ["qkv"], "match_all_linear": False})
    assert missing.returncode == 1 and "lora_cfg.target_modules: 'qkv' is not a linear layer" in missing.stderr
