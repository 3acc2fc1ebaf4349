from rlserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _common_pb2.TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "num_samples", "sampling", "min_weight_version", "run_id", "shared_base", "priority", "routed_experts", "adapter_path", "deployed_base")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_BASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    DEPLOYED_BASE_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    num_samples: int
    sampling: _common_pb2.SamplingParams
    min_weight_version: int
    run_id: str
    shared_base: bool
    priority: float
    routed_experts: bool
    adapter_path: str
    deployed_base: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_weight_version: _Optional[int] = ..., run_id: _Optional[str] = ..., shared_base: _Optional[bool] = ..., priority: _Optional[float] = ..., routed_experts: _Optional[bool] = ..., adapter_path: _Optional[str] = ..., deployed_base: _Optional[bool] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VersionRun(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "text", "version_runs", "routed_experts", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUNS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    text: str
    version_runs: _containers.RepeatedCompositeFieldContainer[VersionRun]
    routed_experts: RoutedExperts
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., text: _Optional[str] = ..., version_runs: _Optional[_Iterable[_Union[VersionRun, _Mapping]]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("num_layers", "experts_per_token", "expert_ids")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    experts_per_token: int
    expert_ids: bytes
    def __init__(self, num_layers: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., expert_ids: _Optional[bytes] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_token_ids", "samples", "prompt_logprobs", "prompt_top_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "weight_version", "replica_id", "engine_seconds", "activity")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    weight_version: int
    replica_id: str
    engine_seconds: float
    activity: EngineActivity
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., weight_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., engine_seconds: _Optional[float] = ..., activity: _Optional[_Union[EngineActivity, _Mapping]] = ...) -> None: ...

class EngineActivity(_message.Message):
    __slots__ = ("uptime_s", "idle_s", "paused_s", "requests_running", "generated_tokens")
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    uptime_s: float
    idle_s: float
    paused_s: float
    requests_running: int
    generated_tokens: int
    def __init__(self, uptime_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., paused_s: _Optional[float] = ..., requests_running: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "store_name", "safetensors_path", "force", "in_flight", "run_id", "shared_base")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_NAME_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_PATH_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_BASE_FIELD_NUMBER: _ClassVar[int]
    version: int
    store_name: str
    safetensors_path: str
    force: bool
    in_flight: bool
    run_id: str
    shared_base: bool
    def __init__(self, version: _Optional[int] = ..., store_name: _Optional[str] = ..., safetensors_path: _Optional[str] = ..., force: _Optional[bool] = ..., in_flight: _Optional[bool] = ..., run_id: _Optional[str] = ..., shared_base: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "num_tensors", "num_bytes", "fetch_seconds", "apply_seconds", "replica_id")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    num_tensors: int
    num_bytes: int
    fetch_seconds: float
    apply_seconds: float
    replica_id: str
    def __init__(self, weight_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., fetch_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., replica_id: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("weight_digests",)
    WEIGHT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    weight_digests: bool
    def __init__(self, weight_digests: _Optional[bool] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "engine", "weight_version", "max_model_len", "vocab_size", "replica_id", "architecture_fingerprint", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "weight_transfer", "activity", "run_id", "lora_enabled", "max_loras", "max_lora_rank", "adapters", "weight_sha256", "routing_unavailable")
    class WeightSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_EAGER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROUTING_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    engine: str
    weight_version: int
    max_model_len: int
    vocab_size: int
    replica_id: str
    architecture_fingerprint: str
    dtype: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    enforce_eager: bool
    weight_transfer: str
    activity: EngineActivity
    run_id: str
    lora_enabled: bool
    max_loras: int
    max_lora_rank: int
    adapters: _containers.RepeatedCompositeFieldContainer[RunAdapter]
    weight_sha256: _containers.ScalarMap[str, str]
    routing_unavailable: str
    def __init__(self, model: _Optional[str] = ..., engine: _Optional[str] = ..., weight_version: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., replica_id: _Optional[str] = ..., architecture_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., enforce_eager: _Optional[bool] = ..., weight_transfer: _Optional[str] = ..., activity: _Optional[_Union[EngineActivity, _Mapping]] = ..., run_id: _Optional[str] = ..., lora_enabled: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[RunAdapter, _Mapping]]] = ..., weight_sha256: _Optional[_Mapping[str, str]] = ..., routing_unavailable: _Optional[str] = ...) -> None: ...

class RunAdapter(_message.Message):
    __slots__ = ("run_id", "version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
