"""The coordinator's spec reader: a real child process, fed by real asyncio pipes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rlserve.config import SpecError, load_spec
from rlserve.runs.spec_reader import READER_NICE, SpecReader
from rlserve.tenancy.policy import CallerLimits, OverLimit

EXAMPLE = (Path(__file__).resolve().parents[3] / "examples/grpo_addition.yaml").read_text()
SLOW = "a: [" + ",".join(["1"] * 120_000) + "]"  # refused at the node bound, after ~30 ms of reading


async def _problems(reader: SpecReader, text: str, caller: str = "alice") -> list[str]:
    with pytest.raises(SpecError) as err:
        await reader.read(text, caller)
    return err.value.problems


def test_it_reads_what_load_spec_reads_in_another_process():
    async def main() -> None:
        reader = SpecReader()
        try:
            assert await reader.read(EXAMPLE, "alice") == load_spec(EXAMPLE)
            assert reader._proc.pid != os.getpid()
            assert os.getpriority(os.PRIO_PROCESS, reader._proc.pid) == READER_NICE
            for bad in ("", "a: 1\na: 2\n", "grpo: {max_num_steps: true}", SLOW):
                with pytest.raises(SpecError) as expected:
                    load_spec(bad)
                assert await _problems(reader, bad) == expected.value.problems
        finally:
            await reader.close()
    asyncio.run(main())


def test_a_caller_with_many_specs_waiting_delays_another_by_one_reading():
    """Before: specs were read in the coordinator's threads, first come first served."""
    async def main() -> None:
        reader = SpecReader()
        done: list[str] = []

        async def submit(text: str, caller: str) -> None:
            try:
                await reader.read(text, caller)
            except SpecError:
                pass
            done.append(caller)
        try:
            await reader.read(EXAMPLE, "warm")
            await asyncio.gather(*(submit(SLOW, "mallory") for _ in range(20)), submit(EXAMPLE, "alice"))
        finally:
            await reader.close()
        assert done.index("alice") <= 1, done
    asyncio.run(main())


def test_a_reader_that_dies_refuses_the_spec_it_was_reading_and_the_next_one_is_read():
    async def main() -> None:
        reader = SpecReader()
        try:
            await reader.read(EXAMPLE, "alice")
            first = reader._proc
            reading = asyncio.create_task(_problems(reader, SLOW))
            await asyncio.sleep(0.005)  # written; its reading takes ~30 ms
            first.kill()
            assert "the reader stopped" in (await reading)[0]
            assert await reader.read(EXAMPLE, "alice") == load_spec(EXAMPLE)
            second = reader._proc
            assert second.pid != first.pid
            second.kill()  # between two specs: the next one starts another, unnoticed
            await second.wait()
            assert await reader.read(EXAMPLE, "alice") == load_spec(EXAMPLE)
        finally:
            await reader.close()
        assert reader._proc is None
    asyncio.run(main())


def test_a_caller_over_its_share_of_the_reader_waits_and_others_do_not():
    """A caller past its burst waits for its share (here a 30 ms spec earns its turn in 3 s, more than the
    1 s a spec may wait, so it is refused), while another caller's spec is read at once."""
    async def main() -> None:
        reader = SpecReader(CallerLimits(spec_reading_share=0.01, spec_reading_burst_s=0.01,
                                         spec_reading_max_wait_s=1.0))
        answered: list[str] = []

        async def submit(text: str, caller: str) -> None:
            try:
                await reader.read(text, caller)
                answered.append(f"{caller} read")
            except SpecError:
                answered.append(f"{caller} read")
            except OverLimit as err:
                answered.append(f"{caller} refused: {err.message}")
        try:
            await reader.read(EXAMPLE, "warm")
            await submit(SLOW, "mallory")  # ~30 ms: the 10 ms burst spent, and 2 s of share owed
            assert answered == ["mallory read"]
            answered.clear()
            await asyncio.gather(submit(SLOW, "mallory"), submit(EXAMPLE, "alice"))
        finally:
            await reader.close()
        assert answered[0] == "alice read" and answered[1].startswith("mallory refused: your spec waited 1 s"), answered
        assert "tenancy.callers.spec_reading_share" in answered[1]
    asyncio.run(main())


def test_a_spec_that_comes_while_the_reader_waits_out_a_share_is_read_at_once():
    """The serving loop sleeps until the spent share is back (here ~30 s away), but not past a new spec."""
    async def main() -> None:
        reader = SpecReader(CallerLimits(spec_reading_share=0.001, spec_reading_burst_s=0.001,
                                         spec_reading_max_wait_s=60.0))
        try:
            await reader.read(EXAMPLE, "warm")
            with pytest.raises(SpecError):
                await reader.read(SLOW, "mallory")  # ~30 ms read: 30 s of share owed
            waiting = asyncio.create_task(reader.read(SLOW, "mallory"))
            await asyncio.sleep(0.2)  # the loop is asleep now
            assert await asyncio.wait_for(reader.read(EXAMPLE, "alice"), 5.0) == load_spec(EXAMPLE)
            assert not waiting.done()
        finally:
            await reader.close()
        assert waiting.cancelled()
    asyncio.run(main())
