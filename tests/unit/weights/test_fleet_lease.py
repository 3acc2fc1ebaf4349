"""A fleet member waiting in a long poll longer than the lease is still a member; one that stopped polling is not."""

from __future__ import annotations

import asyncio
import time

from rlserve.weights import fleet as fleet_module
from rlserve.weights.fleet import PUBLISHED, Fleet, Member


def test_a_member_in_a_long_poll_outlives_the_lease_and_one_that_stopped_polling_does_not(monkeypatch):
    monkeypatch.setattr(fleet_module, "MEMBER_LEASE_S", 0.1)
    fleet = Fleet.__ray_actor_class__()  # the actor's class itself: its logic, in this process

    async def main():
        await fleet.join(Member("polling", None, 0))
        await fleet.join(Member("quiet", None, 0))
        poll = asyncio.ensure_future(fleet.next_command("polling", 30))
        await asyncio.sleep(0.3)  # past the lease: "polling" waits in its poll, "quiet" never polled
        _, members = await fleet.members()
        assert [m.member_id for m in members] == ["polling"]
        t0 = time.monotonic()
        await fleet.announce(1, 1)  # a command reaches a member in a long poll at once
        cmd = await asyncio.wait_for(poll, 5)
        assert cmd.kind == PUBLISHED and time.monotonic() - t0 < 1
        await asyncio.sleep(0.3)  # no poll now, and none for longer than the lease: gone
        assert (await fleet.members())[1] == []
    asyncio.run(main())
