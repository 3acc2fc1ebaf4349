"""Blocking work in a thread that a cancelled caller still waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_thread_to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in a thread. A cancelled caller (Serve cancels a request when its client gives up) still
    waits for the thread to finish before the cancellation goes on, so a lock the caller holds (say, a
    non-re-entrant engine's) is not released while the thread still uses what it guards."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise
