"""A run's policy.generation against the deployed rollout: unset keys filled in, disagreements named."""

from __future__ import annotations

from rlserve.config import parse_spec
from rlserve.rollout.deployed import match_generation
from rlserve.v1 import rollout_pb2

DEPLOYED = rollout_pb2.GetInfoResponse(engine="vllm", dtype="bfloat16", max_model_len=256, tensor_parallel_size=2,
                                       gpu_memory_utilization=0.85, enforce_eager=False)


def test_unset_keys_take_the_deployed_values():
    spec, problems = match_generation(parse_spec({}), DEPLOYED)
    assert problems == []
    gen = spec.policy.generation
    assert gen.backend == "vllm"
    assert (gen.vllm_cfg.precision, gen.vllm_cfg.max_model_len, gen.vllm_cfg.tensor_parallel_size,
            gen.vllm_cfg.gpu_memory_utilization, gen.vllm_cfg.enforce_eager) == ("bfloat16", 256, 2, 0.85, False)


def test_agreeing_keys_pass_and_disagreeing_ones_name_both_values():
    asked = parse_spec({"policy": {"generation": {"backend": "transformers", "vllm_cfg": {
        "tensor_parallel_size": 2, "precision": "float32", "enforce_eager": False}}}})
    spec, problems = match_generation(asked, DEPLOYED)
    assert len(problems) == 2
    assert problems[0].startswith("policy.generation.backend: the run asks for 'transformers' but the rollout "
                                  "service runs 'vllm'")
    assert problems[1].startswith("policy.generation.vllm_cfg.precision: the run asks for 'float32' but the "
                                  "rollout service runs 'bfloat16'")
    assert asked.policy.generation.vllm_cfg.max_model_len is None  # the input is left alone
