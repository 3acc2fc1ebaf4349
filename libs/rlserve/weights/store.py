"""The weight store: the newest policy version for replicas that join late, and the fleet's mailbox.

Two jobs, one named actor that every rollout replica and the learner can find:

- Publications. The newest version, once: the bucket ObjectRefs the learner
  put (never copied again here), or a safetensors folder. A replica that
  starts, restarts or missed a direct transfer loads it. The buckets live as
  long as the learner session that put them (Ray 2.56 removed `ray.put`'s
  `_owner`, and a second copy owned here would double the cost of every
  version); a learner that restarts restores its checkpoint and publishes again.
- The fleet. A handle call reaches one Serve replica, so the learner cannot
  call every rollout engine itself. Each replica `join`s as a member and
  long-polls `next_command`; the learner's weight-sync client fans a command
  out with `command` (vLLM's init/start/update/finish of a direct transfer)
  and gets each member's reply. New publications are announced to every
  member the same way. A member that stops polling, or whose process died
  (its liveness token, an object it owns, is lost with it), is dropped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray

STORE_NAMESPACE = "rlserve"
DEFAULT_STORE_NAME = "rlserve-weights"
# A member that has not polled for this long (and holds no command) is gone.
MEMBER_LEASE_S = 15.0


@dataclass(frozen=True)
class Publication:
    publish_id: int  # increases with every publication; replicas compare it with theirs
    run_id: str
    version: int
    num_tensors: int
    num_bytes: int
    # Replicas apply it to the requests they are running (their samples then span versions);
    # otherwise those finish on the old weights first.
    in_flight: bool = False
    safetensors_path: str | None = None
    # Held inside a list so that Ray hands over the refs instead of resolving them.
    bucket_refs: list[Any] = field(default_factory=list)


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
    kind: str  # "published", or a weight-transfer step: "init", "start", "update", "finish", "abort"
    payload: dict


class _Mailbox:
    def __init__(self, member: Member):
        self.member = member
        self.queue: asyncio.Queue[Command] = asyncio.Queue()
        self.replies: dict[int, asyncio.Future] = {}
        self.last_seen = time.monotonic()

    async def alive(self) -> bool:
        """Polled recently (or busy with a command) and its process still owns its token."""
        if not self.replies and time.monotonic() - self.last_seen > MEMBER_LEASE_S:
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
class WeightStore:
    def __init__(self) -> None:
        self._head: Publication | None = None
        self._boxes: dict[str, _Mailbox] = {}
        self._generation = 0  # changes whenever the membership does
        self._seq = 0
        self._kinds: dict[int, str] = {}  # seq -> kind, of commands awaiting a reply

    # --- publications -----------------------------------------------------------------

    async def publish(self, run_id: str, version: int, bucket_refs: list[Any], num_tensors: int, num_bytes: int,
                      in_flight: bool, safetensors_path: str | None = None) -> int:
        """Make a version the newest (its previous one is released)."""
        publish_id = (self._head.publish_id if self._head else 0) + 1
        self._head = Publication(publish_id, run_id, version, num_tensors, num_bytes, in_flight, safetensors_path,
                                 list(bucket_refs))
        for box in self._boxes.values():
            box.queue.put_nowait(Command(self._next_seq(), "published", {"publish_id": publish_id,
                                                                         "version": version}))
        return publish_id

    async def head(self) -> tuple[int, str, int] | None:
        """(publish_id, run_id, version) of the newest publication, without its refs."""
        if self._head is None:
            return None
        return self._head.publish_id, self._head.run_id, self._head.version

    async def latest(self) -> Publication | None:
        return self._head

    # --- the fleet ---------------------------------------------------------------------

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
        try:
            return await asyncio.wait_for(box.queue.get(), wait_s)
        except asyncio.TimeoutError:
            return None
        finally:
            box.last_seen = time.monotonic()

    async def reply(self, member_id: str, seq: int, error: str | None) -> None:
        box = self._boxes.get(member_id)
        future = box.replies.pop(seq, None) if box else None
        self._kinds.pop(seq, None)
        if future is not None and not future.done():
            future.set_result(error)

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


def get_store(name: str = DEFAULT_STORE_NAME) -> ray.actor.ActorHandle:
    """The named store, created on first use; it outlives its creator (detached) and lives on the head
    node, so losing another node (say, the one running the rollout replicas) loses no published version."""
    return WeightStore.options(name=name, namespace=STORE_NAMESPACE, get_if_exists=True, lifetime="detached",
                               resources={"node:__internal_head__": 0.001}).remote()
