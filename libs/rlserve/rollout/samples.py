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
    if s.top_logprobs is not None:
        sample.top_logprobs.extend(_top(row) for row in s.top_logprobs)
    return sample


def _top(row: tuple[tuple[int, float], ...]) -> rollout_pb2.TopLogprobs:
    return rollout_pb2.TopLogprobs(token_ids=[t for t, _ in row], logprobs=[lp for _, lp in row])


def _completion(ids: list[int], samples: list[GeneratedSample]) -> rollout_pb2.Completion:
    out = rollout_pb2.Completion(prompt_token_ids=ids, samples=[sample_proto(s) for s in samples])
    first = samples[0] if samples else None
    if first is not None and first.prompt_logprobs is not None:
        out.prompt_logprobs.extend(first.prompt_logprobs)
        out.prompt_top_logprobs.extend(_top(row) for row in first.prompt_top_logprobs or ())
    return out


def completions_proto(prompts: list[list[int]], outputs: list[list[GeneratedSample]]) -> list[rollout_pb2.Completion]:
    """One completion per prompt, in order."""
    return [_completion(ids, samples) for ids, samples in zip(prompts, outputs)]
