from rlserve.v1 import common_pb2 as _common_pb2
from rlserve.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[AgentToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[AgentToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class NextEpisodeRequest(_message.Message):
    __slots__ = ("run_id", "wait_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    wait_s: float
    def __init__(self, run_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class NextEpisodeResponse(_message.Message):
    __slots__ = ("episode_id", "task_id", "validation", "prompt", "messages", "answer", "metadata_json", "env_args_json", "timeout_s")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    ENV_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task_id: str
    validation: bool
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[AgentMessage]
    answer: str
    metadata_json: str
    env_args_json: str
    timeout_s: float
    def __init__(self, episode_id: _Optional[str] = ..., task_id: _Optional[str] = ..., validation: _Optional[bool] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[AgentMessage, _Mapping]]] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., env_args_json: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StartEpisodeRequest(_message.Message):
    __slots__ = ("run_id", "task_id", "answer")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task_id: str
    answer: str
    def __init__(self, run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class StartEpisodeResponse(_message.Message):
    __slots__ = ("episode_id", "timeout_s")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    timeout_s: float
    def __init__(self, episode_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("run_id", "episode_id", "messages", "tools_json", "tools_off", "plain", "prompt_text", "prompt_token_ids", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "token_texts")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_OFF_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    episode_id: str
    messages: _containers.RepeatedCompositeFieldContainer[AgentMessage]
    tools_json: str
    tools_off: bool
    plain: bool
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    token_texts: bool
    def __init__(self, run_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[AgentMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., tools_off: _Optional[bool] = ..., plain: _Optional[bool] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., token_texts: _Optional[bool] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "text", "content", "tool_calls", "version_runs", "token_texts")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUNS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    text: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[AgentToolCall]
    version_runs: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.VersionRun]
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., text: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[AgentToolCall, _Mapping]]] = ..., version_runs: _Optional[_Iterable[_Union[_rollout_pb2.VersionRun, _Mapping]]] = ..., token_texts: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("episode_id", "call_id", "prompt_tokens", "choices", "weight_version", "continued")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    call_id: str
    prompt_tokens: int
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    weight_version: int
    continued: bool
    def __init__(self, episode_id: _Optional[str] = ..., call_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., weight_version: _Optional[int] = ..., continued: _Optional[bool] = ...) -> None: ...

class EndEpisodeRequest(_message.Message):
    __slots__ = ("run_id", "episode_id", "reward", "answer")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    episode_id: str
    reward: float
    answer: str
    def __init__(self, run_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., reward: _Optional[float] = ..., answer: _Optional[str] = ...) -> None: ...

class EndEpisodeResponse(_message.Message):
    __slots__ = ("episode_id", "reward", "reward_error", "calls", "sequences")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_ERROR_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    reward: float
    reward_error: str
    calls: int
    sequences: int
    def __init__(self, episode_id: _Optional[str] = ..., reward: _Optional[float] = ..., reward_error: _Optional[str] = ..., calls: _Optional[int] = ..., sequences: _Optional[int] = ...) -> None: ...
