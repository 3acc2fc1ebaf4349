from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_ERROR: _ClassVar[ScoreStatus]
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_ERROR: ScoreStatus

class RewardFunctionSpec(_message.Message):
    __slots__ = ("name", "import_path", "weight", "args_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMPORT_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    import_path: str
    weight: float
    args_json: str
    def __init__(self, name: _Optional[str] = ..., import_path: _Optional[str] = ..., weight: _Optional[float] = ..., args_json: _Optional[str] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("id", "prompt", "completion", "reference_answer", "metadata_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    completion: str
    reference_answer: str
    metadata_json: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., reference_answer: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "functions", "run_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    functions: _containers.RepeatedCompositeFieldContainer[RewardFunctionSpec]
    run_id: str
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., functions: _Optional[_Iterable[_Union[RewardFunctionSpec, _Mapping]]] = ..., run_id: _Optional[str] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "score", "status", "error", "components", "info_json", "metrics")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    id: str
    score: float
    status: ScoreStatus
    error: str
    components: _containers.ScalarMap[str, float]
    info_json: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, id: _Optional[str] = ..., score: _Optional[float] = ..., status: _Optional[_Union[ScoreStatus, str]] = ..., error: _Optional[str] = ..., components: _Optional[_Mapping[str, float]] = ..., info_json: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results", "num_errors", "reward_version", "compute_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REWARD_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    num_errors: int
    reward_version: str
    compute_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ..., num_errors: _Optional[int] = ..., reward_version: _Optional[str] = ..., compute_seconds: _Optional[float] = ...) -> None: ...
