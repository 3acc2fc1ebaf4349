from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvironmentStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENVIRONMENT_STATUS_UNSPECIFIED: _ClassVar[EnvironmentStatus]
    ENVIRONMENT_STATUS_OK: _ClassVar[EnvironmentStatus]
    ENVIRONMENT_STATUS_ERROR: _ClassVar[EnvironmentStatus]
ENVIRONMENT_STATUS_UNSPECIFIED: EnvironmentStatus
ENVIRONMENT_STATUS_OK: EnvironmentStatus
ENVIRONMENT_STATUS_ERROR: EnvironmentStatus

class EnvironmentSpec(_message.Message):
    __slots__ = ("name", "import_path", "args_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMPORT_PATH_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    import_path: str
    args_json: str
    def __init__(self, name: _Optional[str] = ..., import_path: _Optional[str] = ..., args_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("id", "prompt", "messages", "reference_answer", "metadata_json", "env_args_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    ENV_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reference_answer: str
    metadata_json: str
    env_args_json: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reference_answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., env_args_json: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("environment", "episode", "run_id")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    environment: EnvironmentSpec
    episode: Episode
    run_id: str
    def __init__(self, environment: _Optional[_Union[EnvironmentSpec, _Mapping]] = ..., episode: _Optional[_Union[Episode, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("status", "error", "messages", "state_json", "environment_version", "tools_json")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    status: EnvironmentStatus
    error: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    state_json: str
    environment_version: str
    tools_json: str
    def __init__(self, status: _Optional[_Union[EnvironmentStatus, str]] = ..., error: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., state_json: _Optional[str] = ..., environment_version: _Optional[str] = ..., tools_json: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("environment", "episode", "conversation", "assistant", "state_json", "turn", "run_id")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    environment: EnvironmentSpec
    episode: Episode
    conversation: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    assistant: ChatMessage
    state_json: str
    turn: int
    run_id: str
    def __init__(self, environment: _Optional[_Union[EnvironmentSpec, _Mapping]] = ..., episode: _Optional[_Union[Episode, _Mapping]] = ..., conversation: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., assistant: _Optional[_Union[ChatMessage, _Mapping]] = ..., state_json: _Optional[str] = ..., turn: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("status", "error", "observation", "reward", "done", "metrics", "state_json", "environment_version", "compute_seconds")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    status: EnvironmentStatus
    error: str
    observation: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reward: float
    done: bool
    metrics: _containers.ScalarMap[str, float]
    state_json: str
    environment_version: str
    compute_seconds: float
    def __init__(self, status: _Optional[_Union[EnvironmentStatus, str]] = ..., error: _Optional[str] = ..., observation: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., state_json: _Optional[str] = ..., environment_version: _Optional[str] = ..., compute_seconds: _Optional[float] = ...) -> None: ...
