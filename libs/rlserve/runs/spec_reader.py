"""Specs are read in a process of their own, taken in turn from each caller.

Reading a spec is bounded (`rlserve.config.load_spec`: 256 KiB, 20,000 nodes), but at its bound it still
costs ~30 ms of Python, and a worker thread in the coordinator holds the GIL that its run loops need: on
2 cores, one caller sending such specs without pause made a training step 9x slower. Here the coordinator
only ships the text and gets the RunSpec back, and a caller with many specs waiting is served one at a
time, in turn with every other caller, so its queue delays nobody else's spec by more than one reading.

The reader runs at the lowest CPU priority (`READER_NICE`): what it reads at length is mostly what
one caller sends without pause, and at the coordinator's priority it preempted training (niced 10 by
default), whose threads then wait on each other: on 2 cores such a caller still made a step 6x slower.

Each caller also has a share of the reader (`tenancy.callers.spec_reading_share` seconds of reading a
second, in bursts of up to `spec_reading_burst_s`: a token bucket in seconds of reading). A run spec reads in
~3 ms, so no one who submits runs meets it; a caller over it waits, and a spec that waited
`spec_reading_max_wait_s` is refused with `OverLimit` (RESOURCE_EXHAUSTED). Refusing at once instead let the 2-core soak's abuser send 67 specs a second,
each refused but carried through the gateway: a step 4x slower, against 2.4x without the share.

The reader is started on first use and again after it dies; a spec that kills it, or that it does not
answer within `READ_TIMEOUT_S`, is refused. It runs `python -m rlserve.runs.spec_reader` with the
coordinator's interpreter and import path, and speaks length-prefixed pickles on its stdin and stdout
(what it sends back is built by its own code from the text: a RunSpec or a list of problems).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import sys
import time
from collections import OrderedDict, deque

from rlserve.config import RunSpec, SpecError, load_spec
from rlserve.logs import event
from rlserve.rpc import clean
from rlserve.tenancy.policy import CallerLimits
from rlserve.tenancy.token_bucket import TokenBucket

log = logging.getLogger("rlserve.coordinator")
READ_TIMEOUT_S = 10.0
READER_NICE = 19
_LENGTH = struct.Struct("!I")


class SpecReader:
    def __init__(self, limits: CallerLimits | None = None) -> None:
        """`limits`: each caller's share of the reader (None: the defaults)."""
        self.limits = limits or CallerLimits()
        self._proc: asyncio.subprocess.Process | None = None
        # caller -> its specs waiting: (text, answer, when it came)
        self._waiting: OrderedDict[str, deque[tuple[str, asyncio.Future, float]]] = OrderedDict()
        self._serving: asyncio.Task | None = None
        self._arrived = asyncio.Event()  # a spec came while every waiting caller's share was spent
        self._shares: dict[str, TokenBucket] = {}  # caller -> its seconds of reading

    def _share(self, caller: str) -> TokenBucket:
        if caller not in self._shares:
            self._shares[caller] = TokenBucket(self.limits.spec_reading_share, self.limits.spec_reading_burst_s)
        return self._shares[caller]

    async def read(self, text: str, caller: str) -> RunSpec:
        """The spec `text` of `caller` (a principal's name); SpecError naming what is wrong with it,
        OverLimit when it waited `spec_reading_max_wait_s` for the caller's share of the reader."""
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(caller, deque()).append((text, answer, time.monotonic()))
        self._arrived.set()
        if self._serving is None or self._serving.done():
            self._serving = asyncio.create_task(self._serve())
        return await answer

    async def _serve(self) -> None:
        """One spec of each waiting caller in turn, until none waits. A caller whose share is spent waits
        (its specs are read at its share's pace, not refused: a refusal would only bring the next spec
        sooner, and its bytes through the gateway), and its specs that waited too long are refused."""
        while self._waiting:
            caller = next((c for c in self._waiting if self._share(c).level() > 0), None)
            if caller is None:
                self._refuse_overdue()
                self._arrived.clear()
                if self._waiting:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._arrived.wait(), self._until_next_turn())
                continue
            specs = self._waiting.pop(caller)
            text, answer, _ = specs.popleft()
            if specs:
                self._waiting[caller] = specs  # behind every other caller
            if answer.cancelled():
                continue
            began = time.monotonic()
            try:
                result = await self._ask(text)
            except Exception as err:  # noqa: BLE001 - the reader died or hung: this spec is refused, the next is read
                await self._stop()
                event(log, "spec_reader.failed", logging.WARNING, caller=caller, error=clean(repr(err)))
                result = SpecError(["<root>: the spec could not be read (the reader stopped on it)"])
            self._share(caller).take(time.monotonic() - began)
            if not answer.done():
                (answer.set_exception if isinstance(result, SpecError) else answer.set_result)(result)

    def _until_next_turn(self) -> float:
        """Seconds until a waiting caller's share is back or its oldest spec is due to be refused (every
        waiting caller's share was just brought up to date): the serving loop sleeps that long, unless a
        spec comes, so another caller's spec is read at once and an idle loop costs nothing."""
        now = time.monotonic()
        max_wait_s = self.limits.spec_reading_max_wait_s
        return max(0.001, min(min(self._share(caller).seconds_until(0.0), specs[0][2] + max_wait_s - now)
                              for caller, specs in self._waiting.items()))

    def _refuse_overdue(self) -> None:
        now = time.monotonic()
        for caller, specs in list(self._waiting.items()):
            while specs and now - specs[0][2] > self.limits.spec_reading_max_wait_s:
                _, answer, _ = specs.popleft()
                if not answer.done():
                    answer.set_exception(self.limits.spec_waited_too_long())
            if not specs:
                del self._waiting[caller]

    async def _ask(self, text: str) -> RunSpec | SpecError:
        if self._proc is None or self._proc.returncode is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rlserve.runs.spec_reader", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env)
        proc = self._proc
        data = text.encode("utf-8", errors="surrogatepass")
        proc.stdin.write(_LENGTH.pack(len(data)) + data)
        await proc.stdin.drain()
        async with asyncio.timeout(READ_TIMEOUT_S):
            size, = _LENGTH.unpack(await proc.stdout.readexactly(_LENGTH.size))
            ok, value = pickle.loads(await proc.stdout.readexactly(size))  # noqa: S301 - our own child's answer
        return value if ok else SpecError(value)

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def close(self) -> None:
        for specs in self._waiting.values():
            for _, answer, _ in specs:
                answer.cancel()
        self._waiting.clear()
        if self._serving is not None:
            self._serving.cancel()
        await self._stop()


def main() -> None:
    """The reader's loop: a spec's text in, (True, RunSpec) or (False, its problems) out, until stdin ends."""
    os.nice(max(0, READER_NICE - os.nice(0)))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed while reading goes to the log, never into an answer
    while header := stdin.read(_LENGTH.size):
        text = stdin.read(_LENGTH.unpack(header)[0]).decode("utf-8", errors="surrogatepass")
        try:
            answer = (True, load_spec(text))
        except SpecError as err:
            answer = (False, err.problems)
        data = pickle.dumps(answer)
        stdout.write(_LENGTH.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
