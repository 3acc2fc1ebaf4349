"""Where an external_agent run's session and the coordinator's Agents RPCs meet: one table per coordinator.

A run's attempt opens its session here when it first plays episodes (`rlserve.agents.session.session_for`)
and the coordinator's `AgentHub` finds it by run id; the coordinator closes it when the run's task ends.
It holds nothing else (it sits below the loop: `loop/services.py` names it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Session(Protocol):
    def close(self) -> None:
        """Stop serving: episodes still open end as withdrawn, the capture is closed."""


class AgentSessions:
    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._opened = asyncio.Event()  # set (and replaced) whenever a session is put: `wait` sleeps until then

    def get(self, run_id: str) -> Session | None:
        return self._sessions.get(run_id)

    def items(self) -> list[tuple[str, Session]]:
        return list(self._sessions.items())

    def put(self, run_id: str, session: Session) -> None:
        """`session` serves the run from now on (one an earlier attempt left is closed)."""
        old = self._sessions.get(run_id)
        if old is not None and old is not session:
            old.close()
        self._sessions[run_id] = session
        self._opened.set()
        self._opened = asyncio.Event()

    def close(self, run_id: str) -> None:
        session = self._sessions.pop(run_id, None)
        if session is not None:
            session.close()

    async def wait(self, run_id: str, wait_s: float) -> Session | None:
        """The run's session, waiting up to `wait_s` for its attempt to open one."""
        deadline = time.monotonic() + wait_s
        while (session := self._sessions.get(run_id)) is None and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self._opened.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        return session
