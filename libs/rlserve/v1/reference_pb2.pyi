from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoredSequence(_message.Message):
    __slots__ = ("token_ids", "prompt_length")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("sequences", "model_path")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ScoredSequence]
    model_path: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[ScoredSequence, _Mapping]]] = ..., model_path: _Optional[str] = ...) -> None: ...

class SequenceLogProbs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("sequences", "model", "compute_seconds")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceLogProbs]
    model: str
    compute_seconds: float
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceLogProbs, _Mapping]]] = ..., model: _Optional[str] = ..., compute_seconds: _Optional[float] = ...) -> None: ...
