"""An agent waiting for its run's session is woken when the session opens, not by a clock."""

from __future__ import annotations

import asyncio
import time

from rlserve.agents.table import AgentSessions


class _Session:
    def close(self) -> None:
        pass


def test_wait_returns_the_session_as_it_opens_and_none_after_the_wait():
    async def main():
        table, session = AgentSessions(), _Session()
        waiting = asyncio.ensure_future(table.wait("run", 30))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        table.put("run", session)
        assert await asyncio.wait_for(waiting, 5) is session and time.monotonic() - t0 < 1
        assert await table.wait("run", 0) is session  # open already: at once
        t0 = time.monotonic()
        assert await table.wait("other", 0.2) is None and 0.15 < time.monotonic() - t0 < 2
    asyncio.run(main())
