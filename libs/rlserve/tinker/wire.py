"""The SDK's bodies, read with the SDK's own code: `forward_backward` (and `forward`) arrive as its protobuf
(`tinker.proto.tinker_public_pb2`, zstd-compressed when the client config asks), and its results leave as
the protobuf its futures deserialize (`ForwardBackwardOutput`, `SampleResponse`); everything else is JSON
in the shapes of `tinker.types`. Every client mistake is a `UserError` naming the field (`data[2].
loss_fn_inputs.weights`), never an exception of the parser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from rlserve.rollout.interfaces import GeneratedSample, SamplingSpec
from rlserve.tinker.futures import UserError
from rlserve.training.primitives import LOSSES, AdamStep, Datum, loss_config

# What one request may hold, whatever the listener's byte bound: a decompressed body (a zstd bomb is
# refused past it) and one datum's tokens.
MAX_BODY_BYTES = 64 * 2**20


def field_of(body: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = True,
             default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise UserError(name, "is required")
        return default
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise UserError(name, f"must be {_kind(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise UserError(name, f"must be {_kind(kind)}, got {type(value).__name__}")
    return value


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        dict: "an object", list: "a list"}.get(k, k.__name__) for k in kinds)


# --- forward_backward ---------------------------------------------------------------------------


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    forward_only: bool
    loss: str
    config: dict[str, float]
    datums: list[Datum]
    # Per datum: the sampled sequence behind each target row (stable_reinforce), (sequence_id, offset, length)
    target_spans: list[list[tuple[str, int, int, bool]]]


def parse_forward_backward(raw: bytes, content_encoding: str | None) -> pb.ForwardBackwardRequest:
    """The request's protobuf (only the envelope is checked here: its model and seq id decide ordering)."""
    if content_encoding == "zstd" and raw[:4] == b"\x28\xb5\x2f\xfd":  # not yet undone by the listener
        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_BODY_BYTES)
        except zstandard.ZstdError as err:
            raise UserError("body", f"not zstd ({err})") from None
    elif content_encoding not in (None, "identity", "zstd"):
        raise UserError("Content-Encoding", f"{content_encoding!r} is not taken (zstd or none)")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as err:
        raise UserError("body", f"not a ForwardBackwardRequest protobuf ({err})") from None
    if not msg.model_id:
        raise UserError("model_id", "is required")
    if msg.seq_id < 1:
        raise UserError("seq_id", f"must be >= 1, got {msg.seq_id}")
    return msg


def read_datums(msg: pb.ForwardBackwardRequest, vocab_size: int, max_datum_tokens: int,
                max_datums: int) -> FwdBwdRequest:
    """The datums and loss of a parsed request, every shape, dtype, token id and config value checked."""
    loss_name = msg.loss_fn
    if loss_name == "custom":
        raise UserError("loss_fn", "custom losses run client-side on this server (forward_backward_custom "
                                   "with a callable, or a LossHandle without a server-side loss id)")
    loss = LOSSES.get(loss_name)
    if loss is None:
        raise UserError("loss_fn", f"{loss_name!r} is not a loss of this server (it serves: "
                                   f"{', '.join(sorted(LOSSES))})")
    given: dict[str, float] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config.{key}", "must be a number")
        given[key] = value.number
    for key, value in msg.loss_fn_config.items():
        given.setdefault(key, value)
    bad = next((k for k, v in given.items() if not math.isfinite(v)), None)
    if bad is not None:
        raise UserError(f"loss_fn_config.{bad}", "must be finite")
    try:
        config = loss_config(loss, given)
    except ValueError as err:
        field_name, _, problem = str(err).partition(": ")
        raise UserError(field_name, problem) from None
    if not msg.data:
        raise UserError("data", "is empty")
    if len(msg.data) > max_datums:
        raise UserError("data", f"{len(msg.data)} datums; one request takes at most {max_datums}")
    datums, spans = [], []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens = _tokens(d, where, vocab_size, max_datum_tokens)
        n = len(tokens)
        inputs: dict[str, torch.Tensor] = {}
        allowed = {"target_tokens", *loss.required, *loss.optional}
        for name, tensor in d.loss_fn_inputs.items():
            if name not in allowed:
                raise UserError(f"{where}.loss_fn_inputs.{name}", f"{loss_name} takes no such input (it takes: "
                                                                  f"{', '.join(sorted(allowed))})")
            inputs[name] = _tensor(tensor, f"{where}.loss_fn_inputs.{name}", n,
                                   "int64" if name == "target_tokens" else "float32")
        if "target_tokens" not in inputs:
            raise UserError(f"{where}.loss_fn_inputs.target_tokens", "is required")
        targets = inputs.pop("target_tokens").long()
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
            raise UserError(f"{where}.loss_fn_inputs.target_tokens", f"token ids must be in [0, {vocab_size})")
        for name in loss.required:
            if name not in inputs and not (loss.needs_recorded_logprobs and name == "logprobs"):
                raise UserError(f"{where}.loss_fn_inputs.{name}", f"is required by {loss_name}")
        datums.append(Datum(tokens, targets, inputs))
        spans.append(_target_spans(d, where, n))
        if loss.needs_recorded_logprobs and not spans[-1]:
            raise UserError(f"{where}.loss_fn_input_spans", f"{loss_name} needs provenance on every datum "
                                                            f"(Datum.with_provenance)")
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.forward_only, loss_name, config, datums, spans)


def _tokens(d: pb.Datum, where: str, vocab_size: int, max_tokens: int) -> torch.Tensor:
    parts = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"{where}.model_input.chunks[{j}]", f"{kind or 'an empty'} chunk: this server "
                                                                 f"serves text models (token chunks only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(f"{where}.model_input.chunks[{j}].tokens", "is not int32 data")
        parts.append(np.frombuffer(raw, dtype=np.int32))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if not len(tokens):
        raise UserError(f"{where}.model_input", "has no tokens")
    if len(tokens) > max_tokens:
        raise UserError(f"{where}.model_input", f"{len(tokens)} tokens; a datum takes at most {max_tokens}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise UserError(f"{where}.model_input", f"token ids must be in [0, {vocab_size})")
    return torch.from_numpy(tokens.astype(np.int64))


_DTYPES = {pb.DTYPE_FLOAT32: (np.float32, "float32"), pb.DTYPE_INT64: (np.int64, "int64")}


def _tensor(msg: pb.Tensor, where: str, n: int, want: str) -> torch.Tensor:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(where, f"dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
                               f" is not taken (float32 or int64)")
    np_dtype, name = dtype
    if name != want and not (want == "float32" and name == "int64"):
        raise UserError(where, f"must be {want}, got {name}")
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        raise UserError(where, "sparse tensors are not taken (2-D targets are not served); send it dense")
    raw = msg.dense
    if len(raw) % np.dtype(np_dtype).itemsize:
        raise UserError(where, f"is not {name} data")
    values = np.frombuffer(raw, dtype=np_dtype)
    if shape and shape != [len(values)]:
        raise UserError(where, f"shape {shape} is not 1-D of its {len(values)} values (2-D targets are not "
                               f"served)")
    if len(values) != n:
        raise UserError(where, f"{len(values)} values for the datum's {n} input tokens (one per position)")
    if name == "float32" and not np.isfinite(values).all():
        raise UserError(where, "has a value that is not finite")
    out = torch.from_numpy(values.copy())
    return out.float() if want == "float32" else out


def _target_spans(d: pb.Datum, where: str, n: int) -> list[tuple[str, int, int, bool]]:
    spans = []
    for span in d.loss_fn_input_spans:
        kind = span.WhichOneof("span")
        arm = getattr(span, kind)
        spans.append((arm.sequence_id, int(arm.offset), int(arm.length), kind == "sampled_tokens"))
    if spans and sum(s[2] for s in spans) != n:
        raise UserError(f"{where}.loss_fn_input_spans", f"cover {sum(s[2] for s in spans)} rows of {n}")
    return spans


def forward_backward_output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: one ArrayRecord whose `logprobs` field holds every datum's [N] float32."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    arrays = [lp.numpy().astype(np.float32) for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    field_ = record.fields["logprobs"]
    field_.data, field_.offsets, field_.dtype = b"".join(a.tobytes() for a in arrays), offsets.tobytes(), \
        pb.DTYPE_FLOAT32
    return out.SerializeToString()


# --- optim_step -------------------------------------------------------------------------------


def adam(params: Any) -> AdamStep:
    """`OptimStepRequest.adam_params` (the SDK's AdamParams) as the learner's update."""
    if not isinstance(params, dict):
        raise UserError("adam_params", "is required")
    if params.get("type", "adam") not in ("adam", "adamw"):
        raise UserError("adam_params.type", f"{params.get('type')!r}: this server trains with AdamW only")
    known = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "type"}
    extra = sorted(set(params) - known)
    if extra:
        raise UserError(f"adam_params.{extra[0]}", "is not an AdamParams field")
    values = {k: params[k] for k in known - {"type"} if params.get(k) is not None}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"adam_params.{k}", f"must be a finite number, got {v!r}")
    values.setdefault("learning_rate", 1e-4)  # the SDK's default
    step = AdamStep(**{k: float(v) for k, v in values.items()})
    for name, ok in (("learning_rate", step.learning_rate >= 0), ("beta1", 0 <= step.beta1 < 1),
                     ("beta2", 0 <= step.beta2 < 1), ("eps", step.eps >= 0), ("weight_decay", step.weight_decay >= 0),
                     ("grad_clip_norm", step.grad_clip_norm >= 0)):
        if not ok:
            raise UserError(f"adam_params.{name}", f"{getattr(step, name)} is out of range")
    return step


# --- sampling -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleAsk:
    """What a `SampleRequest` asks beyond the samples."""

    sampling: SamplingSpec  # its prompt_logprobs / top_logprobs: what the engine computes
    prompt_logprobs: bool
    topk_prompt: int
    last_n: int | None  # prompt_logprobs_last_n: only the last N prompt positions are scored
    topk_sample: int


def _count(body: dict[str, Any], name: str, high: int) -> int:
    value = field_of(body, name, int, required=False, default=0)
    if not 0 <= value <= high:
        raise UserError(name, f"must be in [0, {high}], got {value}")
    return value


def sample_request(body: dict[str, Any], prompt_len: int, vocab_size: int, max_top: int) -> SampleAsk:
    """A `SampleRequest`'s sampling params and logprob asks, each checked against the prompt and the vocabulary."""
    if body.get("target_prompt_logprobs") is not None:
        raise UserError("target_prompt_logprobs", "is not served by this server (topk_prompt_logprobs is)")
    if body.get("prompt_alt_tokens_k"):
        raise UserError("prompt_alt_tokens_k", "is not served by this server")
    prompt_lps = bool(field_of(body, "prompt_logprobs", bool, required=False, default=False))
    topk_prompt = _count(body, "topk_prompt_logprobs", max_top)
    topk_sample = _count(body, "topk_sample_logprobs", max_top)
    last_n = field_of(body, "prompt_logprobs_last_n", int, required=False)
    if last_n is not None:
        if not prompt_lps:
            raise UserError("prompt_logprobs_last_n", "applies to prompt logprobs: set prompt_logprobs")
        if not 1 <= last_n <= prompt_len - 1:
            raise UserError("prompt_logprobs_last_n", f"must be in [1, {prompt_len - 1}] (the prompt's tokens after "
                                                      f"the first), got {last_n}")
    sampling = _sampling(body.get("sampling_params"), vocab_size)
    asked = prompt_lps or topk_prompt > 0
    return SampleAsk(replace(sampling, prompt_logprobs=topk_prompt if asked else None, top_logprobs=topk_sample),
                     prompt_lps, topk_prompt, last_n, topk_sample)


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    """The SDK's dense top-k matrices; a None row (and a short row's tail) holds its sentinel (token 0,
    logprob -99999)."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), -99999.0, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = tok, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def sample_response(samples: list[GeneratedSample], prompt_logprobs: list[float] | None,
                    prompt_top: list[list[tuple[int, float]]] | None, ask: SampleAsk) -> bytes:
    """`SampleResponse`; prompt logprobs are None (NaN) at position 0, which nothing precedes, and before the
    last `prompt_logprobs_last_n` positions."""
    out = pb.SampleResponse()
    for s in samples:
        seq = out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.finish_reason == "stop"
                                else pb.STOP_REASON_LENGTH)
        seq.tokens = np.asarray(s.token_ids, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if ask.topk_sample:
            seq.topk_sampled_logprobs.CopyFrom(_topk([list(r) for r in s.top_logprobs or ()], ask.topk_sample))
    if prompt_logprobs is None:
        return out.SerializeToString()
    n = len(prompt_logprobs)  # the prompt's length - 1
    skip = n - ask.last_n if ask.last_n is not None else 0
    if ask.prompt_logprobs:
        values = np.asarray([math.nan, *prompt_logprobs], dtype=np.float32)
        values[1:1 + skip] = math.nan
        out.prompt_logprobs = values.tobytes()
    if ask.topk_prompt:
        rows: list[list[tuple[int, float]] | None] = [None, *(prompt_top or [[]] * n)]
        for i in range(1, 1 + skip):
            rows[i] = None
        out.topk_prompt_logprobs.CopyFrom(_topk(rows, ask.topk_prompt))
    return out.SerializeToString()


def prompt_tokens(prompt: Any, vocab_size: int, max_tokens: int) -> list[int]:
    """`SampleRequest.prompt` (a ModelInput as JSON) as token ids."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt", "must be a ModelInput ({'chunks': [...]})")
    tokens: list[int] = []
    for j, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt.chunks[{j}]", "this server serves text models (token chunks only)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"prompt.chunks[{j}].tokens", "must be a list of integers")
        tokens += ids
    if not tokens:
        raise UserError("prompt", "has no tokens")
    if len(tokens) > max_tokens:
        raise UserError("prompt", f"{len(tokens)} tokens; a prompt takes at most {max_tokens}")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise UserError("prompt", f"token ids must be in [0, {vocab_size})")
    return tokens


def _sampling(params: Any, vocab_size: int) -> SamplingSpec:
    if not isinstance(params, dict):
        raise UserError("sampling_params", "is required")
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        max_tokens = 16
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 8192:
        raise UserError("sampling_params.max_tokens", f"must be an integer in [1, 8192], got {max_tokens!r}")
    temperature = params.get("temperature", 1.0)
    top_p = params.get("top_p", 1.0)
    top_k = params.get("top_k", -1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 100:
        raise UserError("sampling_params.temperature", f"must be in [0, 100], got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError("sampling_params.top_p", f"must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise UserError("sampling_params.top_k", f"must be -1 or >= 1, got {top_k!r}")
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        strings = tuple(stop)  # [] too: no stop sequences
    elif isinstance(stop, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in stop):
        if any(not 0 <= x < vocab_size for x in stop):
            raise UserError("sampling_params.stop", f"token ids must be in [0, {vocab_size})")
        token_ids = tuple(stop)
    elif stop is not None:
        raise UserError("sampling_params.stop", "must be a string, a list of strings or a list of token ids")
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UserError("sampling_params.seed", f"must be an integer, got {seed!r}")
    return SamplingSpec(temperature=float(temperature), top_p=float(top_p), top_k=None if top_k == -1 else top_k,
                        max_new_tokens=max_tokens, stop_strings=strings, stop_token_ids=token_ids, seed=seed)
