"""The fleet: a mailbox per rollout replica, so that one caller can reach every replica.

A handle call reaches one Serve replica, so the learner cannot call every
rollout engine itself. Each replica `join`s as a member and long-polls
`next_command`; the learner's weight-sync client fans a command out with
`command` (vLLM's init/update/finish of a direct transfer; a round's start rides
with its first update, a round trip fewer) and gets each member's reply. `announce` tells every member of a new publication in the
weight store (`store.py`) without waiting for replies: a member loads it from
the store unless it already serves that version. A member that stops polling,
or whose process died (its liveness token, an object it owns, is lost with
it), is dropped.

Each weight store has its own fleet, named after it (`get_fleet`): services
are configured with the store's name only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray

from rlserve.weights.store import named_on_head

# A member that has not polled for this long (and is neither in a poll nor holding a command) is gone.
MEMBER_LEASE_S = 15.0
# The kind of an announcement; the other kinds are weight-transfer steps.
PUBLISHED = "published"


@dataclass(frozen=True)
class Member:
    member_id: str
    # The vLLM weight-transfer engine it receives through, or None (publications only).
    transfer_backend: str | None
    # Ranks it adds to a transfer group (the engine's workers).
    num_workers: int
    # [ObjectRef] of an object the member's process owns: it is lost when that process dies.
    token: tuple = ()


@dataclass(frozen=True)
class Command:
    seq: int
    kind: str  # PUBLISHED, or a weight-transfer step: "init", "update", "finish", "abort"
    payload: dict


class _Mailbox:
    def __init__(self, member: Member):
        self.member = member
        self.queue: asyncio.Queue[Command] = asyncio.Queue()
        self.replies: dict[int, asyncio.Future] = {}
        self.last_seen = time.monotonic()
        self.polls = 0  # long polls waiting now (a member waits in one for as long as it asked)

    async def alive(self) -> bool:
        """Polling now or recently (or busy with a command), and its process still owns its token."""
        if not self.replies and not self.polls and time.monotonic() - self.last_seen > MEMBER_LEASE_S:
            return False
        for ref in self.member.token:
            try:
                await asyncio.wait_for(ref, 5.0)
            except asyncio.TimeoutError:
                pass
            except ray.exceptions.RayError:  # the owner died, the object with it
                return False
        return True


@ray.remote(num_cpus=0)
class Fleet:
    def __init__(self) -> None:
        self._boxes: dict[str, _Mailbox] = {}
        self._generation = 0  # changes whenever the membership does
        self._seq = 0
        self._kinds: dict[int, str] = {}  # seq -> kind, of commands awaiting a reply

    async def join(self, member: Member) -> None:
        self._boxes[member.member_id] = _Mailbox(member)
        self._generation += 1

    async def leave(self, member_id: str) -> None:
        box = self._boxes.pop(member_id, None)
        if box is not None:
            for seq in box.replies:
                self._kinds.pop(seq, None)
            self._generation += 1

    async def members(self) -> tuple[int, list[Member]]:
        """(membership generation, the live members); members found gone are dropped here."""
        gone = [m for m, box in list(self._boxes.items()) if not await box.alive()]
        for member_id in gone:
            await self.leave(member_id)
        return self._generation, [box.member for box in self._boxes.values()]

    async def pending(self) -> dict[str, list[str]]:
        """Member id -> the commands it has not answered yet (what a transfer is waiting for)."""
        return {m: [self._kinds[seq] for seq in box.replies] for m, box in self._boxes.items() if box.replies}

    async def next_command(self, member_id: str, wait_s: float) -> Command | None:
        """A member's long poll: its next command, or None after `wait_s`. KeyError: not a member (re-join)."""
        box = self._boxes[member_id]
        box.last_seen = time.monotonic()
        box.polls += 1
        try:
            return await asyncio.wait_for(box.queue.get(), wait_s)
        except asyncio.TimeoutError:
            return None
        finally:
            box.polls -= 1
            box.last_seen = time.monotonic()

    async def reply(self, member_id: str, seq: int, error: str | None) -> None:
        box = self._boxes.get(member_id)
        future = box.replies.pop(seq, None) if box else None
        self._kinds.pop(seq, None)
        if future is not None and not future.done():
            future.set_result(error)

    async def announce(self, publish_id: int, version: int) -> None:
        """Tell every member that the store holds a new publication (members do not reply)."""
        for box in self._boxes.values():
            box.queue.put_nowait(Command(self._next_seq(), PUBLISHED, {"publish_id": publish_id,
                                                                       "version": version}))

    async def command(self, kind: str, payloads: dict[str, dict], timeout_s: float) -> dict[str, str | None]:
        """Send each member its payload; member id -> None (done) or the error (also: gone, timed out)."""
        waits: dict[str, asyncio.Future] = {}
        seqs: dict[str, int] = {}
        results: dict[str, str | None] = {}
        loop = asyncio.get_running_loop()
        for member_id, payload in payloads.items():
            box = self._boxes.get(member_id)
            if box is None:
                results[member_id] = "not a member (gone)"
                continue
            seq = seqs[member_id] = self._next_seq()
            waits[member_id] = box.replies[seq] = loop.create_future()
            self._kinds[seq] = kind
            box.queue.put_nowait(Command(seq, kind, payload))
        deadline = loop.time() + timeout_s
        pending = dict(waits)
        while pending and loop.time() < deadline:
            await asyncio.wait(pending.values(), timeout=min(1.0, deadline - loop.time()))
            for member_id in [m for m, f in pending.items() if f.done()]:
                del pending[member_id]
            for member_id in list(pending):  # a member that died mid-command never replies
                box = self._boxes.get(member_id)
                if box is None or not await box.alive():
                    pending.pop(member_id).set_result("the replica is gone")
                    await self.leave(member_id)
        for member_id, future in waits.items():
            if not future.done():  # stop waiting for it (the member may still answer; it is ignored)
                box = self._boxes.get(member_id)
                if box is not None:
                    box.replies.pop(seqs[member_id], None)
                self._kinds.pop(seqs[member_id], None)
            results[member_id] = future.result() if future.done() else f"no reply within {timeout_s:.0f}s"
        return results

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


def fleet_name(store_name: str) -> str:
    return f"{store_name}-fleet"


def get_fleet(store_name: str) -> ray.actor.ActorHandle:
    """The fleet of the weight store `store_name` (named after it, on the head node like the store)."""
    return named_on_head(Fleet, fleet_name(store_name))
