"""The environment contract.

An episode starts from a data row (`Episode`): `reset` returns the first
messages the policy sees and the episode's state; each `step` gets the
conversation so far, the policy's last message and that state, and returns an
observation (messages appended after the policy's message), a reward, whether
the episode is done, metrics, and the next state.

Where the state lives: it travels with the episode. The caller keeps what
`reset` or `step` returned and passes it back in the next `step`; an
environment object keeps nothing per episode, so any replica answers any call
and nothing has to be closed. The state must be JSON data (at most
`serving.MAX_STATE_CHARS` as JSON). An episode ends when `step` says done, or
when the caller stops it (its turn limit, its token budget, a time-out), and
its state is then dropped.

Plug-ins are classes constructed with the `args` of their spec as keyword
arguments; their methods are synchronous (the service runs them in a thread)
and may raise: the episode then ends with an error (its group is dropped and
counted), never the service.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# A chat message as the chat template takes it: {"role": ..., "content": ...}.
Message = dict[str, str]


@dataclass(frozen=True)
class Episode:
    """The data row an episode starts from."""

    id: str
    prompt: str  # the prompt text (a chat row: its last user message)
    messages: tuple[Message, ...]  # the row's conversation, or the prompt as a user message
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    env_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResetOutput:
    messages: list[Message]
    state: Any = None
    # Function schemas (`{"type": "function", "function": {...}}`) the policy's chat template renders
    # as its `tools=`; None: the messages declare whatever tools there are.
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class StepInput:
    episode: Episode
    conversation: list[Message]  # every message before the policy's last one
    assistant: str  # the policy's last message
    state: Any
    turn: int  # 1 for the first step


@dataclass(frozen=True)
class StepOutput:
    observation: list[Message]  # appended after the policy's message (empty when done)
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)
    state: Any = None


class Environment(ABC):
    name: str = "environment"

    def reset(self, episode: Episode) -> ResetOutput:
        """The row's own conversation, and no state (override to add instructions or state)."""
        return ResetOutput(list(episode.messages))

    @abstractmethod
    def step(self, step: StepInput) -> StepOutput: ...
