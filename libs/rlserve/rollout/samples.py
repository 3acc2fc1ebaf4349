"""An engine's samples as the rollout service answers them (`rollout_pb2.Completion`): the service and the
in-process harnesses of the tests build the same messages."""

from __future__ import annotations

from rlserve.models import moe_routing
from rlserve.rollout.interfaces import GeneratedSample
from rlserve.v1 import common_pb2, rollout_pb2

FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "abort": common_pb2.FINISH_REASON_ABORT}


def sample_proto(s: GeneratedSample) -> rollout_pb2.Sample:
    sample = rollout_pb2.Sample(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=FINISH[s.finish_reason],
                                text=s.text, version_runs=[rollout_pb2.VersionRun(version=r.version, start=r.start,
                                                                                  end=r.end)
                                                           for r in s.version_runs])
    if s.routed_experts is not None:
        layers, k, data = moe_routing.encode(s.routed_experts)
        sample.routed_experts.CopyFrom(rollout_pb2.RoutedExperts(num_layers=layers, experts_per_token=k,
                                                                 expert_ids=data))
    return sample


def completions_proto(prompts: list[list[int]], outputs: list[list[GeneratedSample]]) -> list[rollout_pb2.Completion]:
    """One completion per prompt, in order."""
    return [rollout_pb2.Completion(prompt_token_ids=ids, samples=[sample_proto(s) for s in samples])
            for ids, samples in zip(prompts, outputs)]
