from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConfigureRequest(_message.Message):
    __slots__ = ("run_id", "spec_yaml", "init_model_path", "shared_base")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    INIT_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SHARED_BASE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_yaml: str
    init_model_path: str
    shared_base: bool
    def __init__(self, run_id: _Optional[str] = ..., spec_yaml: _Optional[str] = ..., init_model_path: _Optional[str] = ..., shared_base: _Optional[bool] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("backend", "world_size", "parallel_layout", "num_parameters", "weight_version", "device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    world_size: int
    parallel_layout: str
    num_parameters: int
    weight_version: int
    device: str
    def __init__(self, backend: _Optional[str] = ..., world_size: _Optional[int] = ..., parallel_layout: _Optional[str] = ..., num_parameters: _Optional[int] = ..., weight_version: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class TrainSequence(_message.Message):
    __slots__ = ("token_ids", "prompt_length", "advantage", "generator_logprobs", "reference_logprobs", "token_advantages", "loss_mask")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    advantage: float
    generator_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reference_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_advantages: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., advantage: _Optional[float] = ..., generator_logprobs: _Optional[_Iterable[float]] = ..., reference_logprobs: _Optional[_Iterable[float]] = ..., token_advantages: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[bool]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("run_id", "loss_name", "sequences", "learning_rate", "expected_weight_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_NAME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    loss_name: str
    sequences: _containers.RepeatedCompositeFieldContainer[TrainSequence]
    learning_rate: float
    expected_weight_version: int
    def __init__(self, run_id: _Optional[str] = ..., loss_name: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TrainSequence, _Mapping]]] = ..., learning_rate: _Optional[float] = ..., expected_weight_version: _Optional[int] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("weight_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ExportWeightsRequest(_message.Message):
    __slots__ = ("run_id", "store_name", "direct", "in_flight", "shared_base")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_NAME_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SHARED_BASE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    store_name: str
    direct: bool
    in_flight: bool
    shared_base: bool
    def __init__(self, run_id: _Optional[str] = ..., store_name: _Optional[str] = ..., direct: _Optional[bool] = ..., in_flight: _Optional[bool] = ..., shared_base: _Optional[bool] = ...) -> None: ...

class ExportWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "num_buckets", "num_tensors", "num_bytes", "seconds", "direct_bytes", "receivers", "failed", "model_bytes", "direct_seconds", "store_seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    num_buckets: int
    num_tensors: int
    num_bytes: int
    seconds: float
    direct_bytes: int
    receivers: int
    failed: _containers.RepeatedScalarFieldContainer[str]
    model_bytes: int
    direct_seconds: float
    store_seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., num_buckets: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., direct_bytes: _Optional[int] = ..., receivers: _Optional[int] = ..., failed: _Optional[_Iterable[str]] = ..., model_bytes: _Optional[int] = ..., direct_seconds: _Optional[float] = ..., store_seconds: _Optional[float] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "path", "hf_path")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HF_PATH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    hf_path: str
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ..., hf_path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    weight_version: int
    def __init__(self, path: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "path")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class FloatList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("tokens", "target_tokens", "inputs")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: FloatList
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[FloatList, _Mapping]] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    inputs: _containers.MessageMap[str, FloatList]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., inputs: _Optional[_Mapping[str, FloatList]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("run_id", "datums", "loss_fn", "loss_fn_config", "backward")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATUMS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    datums: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    backward: bool
    def __init__(self, run_id: _Optional[str] = ..., datums: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., backward: _Optional[bool] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("logprobs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[FloatList]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, logprobs: _Optional[_Iterable[_Union[FloatList, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("run_id", "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, run_id: _Optional[str] = ..., learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("weight_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
