"""`engine: auto` (the GPU cluster files'): vLLM where it can generate on the replica's device, else the transformers
engine, with a warning that says why."""

from __future__ import annotations

import logging
import sys

from rlserve.models import resolve_model
from rlserve.rollout import make_engine
from rlserve.rollout.interfaces import EngineConfig
from rlserve.rollout.registry import vllm_missing


def test_vllm_counts_only_where_its_build_runs_on_the_replicas_device(monkeypatch):
    assert vllm_missing("cpu") is None  # this machine: vLLM's CPU build
    assert "is installed for cpu, and this replica generates on cuda" in vllm_missing("cuda")
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where it is not installed
    assert vllm_missing("cpu") == "vLLM is not installed here"


def test_without_vllm_the_transformers_engine_generates_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with caplog.at_level(logging.WARNING, logger="rlserve.rollout"):
        engine = make_engine("auto", EngineConfig(model_path=resolve_model("preset:tiny"), device="cpu"))
    assert engine.name == "transformers"
    assert "engine auto: vLLM is not installed here" in caplog.text
    assert "the transformers engine generates instead" in caplog.text


def test_deploy_serve_up_names_the_engine_auto_chose():
    from rlserve.cluster.cli import _engine_line

    assert "rollout engine: transformers, not vLLM" in _engine_line("transformers")
    assert _engine_line("vllm").startswith("serve: rollout engine: vllm")
