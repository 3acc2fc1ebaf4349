"""A cancelled caller of `in_thread_to_the_end` still waits for the thread (a lock it holds stays held)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlserve.threads import in_thread_to_the_end


def test_a_cancelled_caller_keeps_its_lock_until_the_thread_ends():
    finished = threading.Event()

    def work() -> None:
        time.sleep(0.3)
        finished.set()

    async def scenario() -> None:
        lock = asyncio.Lock()

        async def caller() -> None:
            async with lock:
                await in_thread_to_the_end(work)

        task = asyncio.create_task(caller())
        await asyncio.sleep(0.05)
        task.cancel()
        async with lock:  # what would next use the engine
            assert finished.is_set(), "the lock was released while the thread still ran"
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert asyncio.run(_value()) == 42


async def _value() -> int:
    return await in_thread_to_the_end(lambda: 42)
