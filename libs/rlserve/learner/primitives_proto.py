"""The learner's primitives on the wire (`Forward`, `OptimStep` of learner.proto) and back: what the
learner service decodes and its callers (the Tinker API on a cluster) encode. Decoding checks what the
learner alone can check (a known loss, its config, one value per input token); a ValueError names the
field. Token ids against the vocabulary are the caller's to check (the Tinker API does, per field).
"""

from __future__ import annotations

import math

import torch

from rlserve.learner.interfaces import StepResult
from rlserve.training.primitives import LOSSES, AdamStep, Datum, DatumBatch, PrimitiveResult, loss_config
from rlserve.v1 import learner_pb2


def forward_request(run_id: str, batch: DatumBatch, backward: bool) -> learner_pb2.ForwardRequest:
    return learner_pb2.ForwardRequest(
        run_id=run_id, loss_fn=batch.loss, loss_fn_config=batch.config, backward=backward,
        datums=[learner_pb2.Datum(tokens=d.tokens.tolist(), target_tokens=d.targets.tolist(),
                                  inputs={k: learner_pb2.FloatList(values=v.tolist()) for k, v in d.inputs.items()})
                for d in batch.datums])


def batch_from_proto(request: learner_pb2.ForwardRequest) -> DatumBatch:
    """The request's datums and loss; ValueError "FIELD: problem" for what the learner cannot train on."""
    loss = LOSSES.get(request.loss_fn)
    if loss is None:
        raise ValueError(f"loss_fn: {request.loss_fn[:64]!r} is not a primitive loss (valid: "
                         f"{', '.join(sorted(LOSSES))})")
    config = loss_config(loss, dict(request.loss_fn_config))
    if not request.datums:
        raise ValueError("datums: empty")
    datums = []
    for i, d in enumerate(request.datums):
        n = len(d.tokens)
        if not n:
            raise ValueError(f"datums[{i}].tokens: empty")
        if len(d.target_tokens) != n:
            raise ValueError(f"datums[{i}].target_tokens: {len(d.target_tokens)} for {n} tokens")
        if min(d.tokens) < 0 or min(d.target_tokens) < 0:
            raise ValueError(f"datums[{i}]: negative token ids")
        inputs = {}
        for name, values in d.inputs.items():
            if name not in loss.required and name not in loss.optional:
                raise ValueError(f"datums[{i}].inputs.{name}: {loss.name} takes no such input")
            if len(values.values) != n:
                raise ValueError(f"datums[{i}].inputs.{name}: {len(values.values)} values for {n} tokens")
            if not all(math.isfinite(v) for v in values.values):
                raise ValueError(f"datums[{i}].inputs.{name}: a value is not finite")
            inputs[name] = torch.tensor(values.values, dtype=torch.float32)
        missing = [name for name in loss.required if name not in inputs]
        if missing:
            raise ValueError(f"datums[{i}].inputs.{missing[0]}: required by {loss.name}")
        datums.append(Datum(torch.tensor(list(d.tokens), dtype=torch.long),
                            torch.tensor(list(d.target_tokens), dtype=torch.long), inputs))
    return DatumBatch(datums, loss.name, config)


def forward_response(result: PrimitiveResult) -> learner_pb2.ForwardResponse:
    return learner_pb2.ForwardResponse(logprobs=[learner_pb2.FloatList(values=lp.tolist()) for lp in result.logprobs],
                                       metrics=result.metrics)


def result_from_proto(response: learner_pb2.ForwardResponse) -> PrimitiveResult:
    return PrimitiveResult([torch.tensor(list(lp.values), dtype=torch.float32) for lp in response.logprobs],
                           dict(response.metrics))


_ADAM_OPTIONAL = ("beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def optim_request(run_id: str, step: AdamStep) -> learner_pb2.OptimStepRequest:
    return learner_pb2.OptimStepRequest(run_id=run_id, learning_rate=step.learning_rate,
                                        **{k: getattr(step, k) for k in _ADAM_OPTIONAL})


def adam_from_proto(request: learner_pb2.OptimStepRequest) -> AdamStep:
    """The update's settings; ValueError "FIELD: problem" for a value out of range."""
    step = AdamStep(request.learning_rate, **{k: getattr(request, k) for k in _ADAM_OPTIONAL if request.HasField(k)})
    for name, ok in (("learning_rate", step.learning_rate >= 0), ("beta1", 0 <= step.beta1 < 1),
                     ("beta2", 0 <= step.beta2 < 1), ("eps", step.eps >= 0), ("weight_decay", step.weight_decay >= 0),
                     ("grad_clip_norm", step.grad_clip_norm >= 0)):
        value = getattr(step, name)
        if not ok or not math.isfinite(value):
            raise ValueError(f"{name}: {value} is out of range")
    return step


def optim_response(result: StepResult) -> learner_pb2.OptimStepResponse:
    return learner_pb2.OptimStepResponse(weight_version=result.version, metrics=result.metrics)


def step_from_proto(response: learner_pb2.OptimStepResponse) -> StepResult:
    return StepResult(response.weight_version, dict(response.metrics))
