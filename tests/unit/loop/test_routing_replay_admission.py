"""SubmitRun admits `policy.routing_replay` only for a Mixtral- or Qwen3-MoE-shaped model and a rollout engine
that records routing, naming the key and the engine's reason."""

from __future__ import annotations

import pytest

from rlserve.config import parse_spec
from rlserve.loop.admission import RunAdmission
from rlserve.models import hf_config
from rlserve.rpc import RpcError
from rlserve.v1 import rollout_pb2


def check(model: str, routing_unavailable: str = "") -> None:
    spec = parse_spec({"policy": {"model_name": model, "routing_replay": True}})
    RunAdmission._check_routing_replay(spec, hf_config(model), rollout_pb2.GetInfoResponse(
        engine="vllm", routing_unavailable=routing_unavailable))


def test_routing_replay_needs_a_supported_moe_model_and_an_engine_that_records_routing():
    check("preset:qwen3-moe-tiny")
    check("preset:moe-tiny")
    with pytest.raises(RpcError, match="policy.routing_replay.*is 'llama'"):
        check("preset:tiny")
    with pytest.raises(RpcError, match=r"policy.routing_replay: the rollout's vllm engine cannot record MoE routing "
                                       r"\(on GPUs only\)"):
        check("preset:qwen3-moe-tiny", "on GPUs only")
