from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_QUEUED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_SUCCEEDED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_CANCELLED: _ClassVar[RunState]
    RUN_STATE_CANCELLING: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_STATE: _ClassVar[EventKind]
    EVENT_KIND_STEP: _ClassVar[EventKind]
    EVENT_KIND_WEIGHT_SYNC: _ClassVar[EventKind]
    EVENT_KIND_REWARD_SWAP: _ClassVar[EventKind]
    EVENT_KIND_DROPPED: _ClassVar[EventKind]
    EVENT_KIND_RETRY: _ClassVar[EventKind]
    EVENT_KIND_ERROR: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT: _ClassVar[EventKind]
    EVENT_KIND_VALIDATION: _ClassVar[EventKind]
    EVENT_KIND_INFO: _ClassVar[EventKind]
    EVENT_KIND_RECOVERED: _ClassVar[EventKind]
    EVENT_KIND_WARNING: _ClassVar[EventKind]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_QUEUED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_SUCCEEDED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_CANCELLED: RunState
RUN_STATE_CANCELLING: RunState
RUN_STATE_PAUSED: RunState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_STATE: EventKind
EVENT_KIND_STEP: EventKind
EVENT_KIND_WEIGHT_SYNC: EventKind
EVENT_KIND_REWARD_SWAP: EventKind
EVENT_KIND_DROPPED: EventKind
EVENT_KIND_RETRY: EventKind
EVENT_KIND_ERROR: EventKind
EVENT_KIND_CHECKPOINT: EventKind
EVENT_KIND_VALIDATION: EventKind
EVENT_KIND_INFO: EventKind
EVENT_KIND_RECOVERED: EventKind
EVENT_KIND_WARNING: EventKind

class Ledger(_message.Message):
    __slots__ = ("generated", "scored", "trained", "dropped", "in_flight")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    generated: int
    scored: int
    trained: int
    dropped: _containers.ScalarMap[str, int]
    in_flight: int
    def __init__(self, generated: _Optional[int] = ..., scored: _Optional[int] = ..., trained: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ..., in_flight: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "name", "state", "step", "max_steps", "weight_version", "run_dir", "error", "ledger", "last_metrics", "created_unix", "updated_unix", "final_model_path", "plot_path", "owner", "usage")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    PLOT_PATH_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    state: RunState
    step: int
    max_steps: int
    weight_version: int
    run_dir: str
    error: str
    ledger: Ledger
    last_metrics: _containers.ScalarMap[str, float]
    created_unix: float
    updated_unix: float
    final_model_path: str
    plot_path: str
    owner: str
    usage: Usage
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., max_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., run_dir: _Optional[str] = ..., error: _Optional[str] = ..., ledger: _Optional[_Union[Ledger, _Mapping]] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ..., final_model_path: _Optional[str] = ..., plot_path: _Optional[str] = ..., owner: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("generated_tokens", "trained_tokens", "generation_device_seconds", "training_device_seconds")
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generated_tokens: int
    trained_tokens: int
    generation_device_seconds: float
    training_device_seconds: float
    def __init__(self, generated_tokens: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., generation_device_seconds: _Optional[float] = ..., training_device_seconds: _Optional[float] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("spec_yaml", "run_id", "resume")
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    run_id: str
    resume: bool
    def __init__(self, spec_yaml: _Optional[str] = ..., run_id: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class SubmitRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CancelRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("sequence", "time_unix", "run_id", "step", "kind", "message", "metrics", "state")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    time_unix: float
    run_id: str
    step: int
    kind: EventKind
    message: str
    metrics: _containers.ScalarMap[str, float]
    state: RunState
    def __init__(self, sequence: _Optional[int] = ..., time_unix: _Optional[float] = ..., run_id: _Optional[str] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., message: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id", "from_sequence")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_sequence: int
    def __init__(self, run_id: _Optional[str] = ..., from_sequence: _Optional[int] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: RunEvent
    def __init__(self, event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...
