"""Leases against a real nats-server: tokens, renewal, release, expiry by the server."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from nats.aio.client import Client

from shared.bus import names
from shared.state.lease import Lease, is_held
from tests.support.stack import eventually


async def test_one_holder_at_a_time_and_tokens_only_grow(declared: Client) -> None:
    nc = declared
    js = nc.jetstream()
    a, b = Lease(js, "run1", "a", ttl_s=30), Lease(js, "run1", "b", ttl_s=30)
    assert await a.acquire()
    assert not await b.acquire()
    assert await a.renew() and a.revision > a.token
    await a.release()
    assert await b.acquire(), "a released lease must be free at once"
    assert b.token > a.token
    assert not await a.renew(), "the old holder's renewal must lose its CAS"


async def test_expiry_is_decided_by_the_server(declared: Client) -> None:
    nc = declared
    js = nc.jetstream()
    a, b = Lease(js, "run2", "a", ttl_s=2), Lease(js, "run2", "b", ttl_s=2)
    assert await a.acquire()
    assert not await b.acquire()

    async def lapsed() -> bool:
        return not await is_held(js, "run2")

    await eventually(lapsed, 10, "the lease to lapse")
    assert await b.acquire() and b.token > a.token
    assert not await a.renew()


async def test_renewal_keeps_a_lease_alive_past_its_ttl(declared: Client) -> None:
    nc = declared
    js = nc.jetstream()
    a, b = Lease(js, "run3", "a", ttl_s=2), Lease(js, "run3", "b", ttl_s=2)
    assert await a.acquire()
    for _ in range(5):
        assert await a.renew()
        assert not await b.acquire()
        # The passage of time is what is under test here: 5 renewals a third of the TTL
        # apart span well past the TTL.
        await asyncio.sleep(0.6)


async def test_release_frees_the_lease_after_a_renewal_it_did_not_hear_of(
    declared: Client,
) -> None:
    js = declared.jetstream()
    a = Lease(js, "run4", "a", ttl_s=30)
    assert await a.acquire()
    stale = a.revision
    assert await a.renew()
    a.revision = stale  # as if the renewal landed but its reply was lost
    await a.release()
    b = Lease(js, "run4", "b", ttl_s=30)
    assert await b.acquire(), "the lease must be free at once"
    stale_b = Lease(js, "run4", "c", ttl_s=30)
    stale_b.revision = 1
    await stale_b.release()  # someone else's lease is never released
    assert await is_held(js, "run4")


async def test_a_renewal_that_landed_unheard_of_keeps_the_lease(declared: Client) -> None:
    """A hub electing a new leader can lose a renewal's answer after storing it; the next
    renewal's CAS then fails on the holder's own write, which must not cost the lease."""
    js = declared.jetstream()
    a = Lease(js, "run5", "a", ttl_s=30)
    assert await a.acquire()
    stale = a.revision
    assert await a.renew()
    landed = a.revision
    a.revision = stale  # as if the renewal landed but its reply was lost
    assert await a.renew(), "the lease is still a's"
    assert a.revision > landed
    assert await a.renew()
    b = Lease(js, "run5", "b", ttl_s=30)
    assert not await b.acquire()
    await a.release()
    assert await b.acquire()
    a.revision = stale
    assert not await a.renew(), "b's lease must never be taken for a's"


async def test_an_expiry_marker_counts_as_no_lease(declared: Client) -> None:
    """The server leaves a marker where a lease expired; while it lives, every read must see
    no holder, and a new holder's create must pass its CAS."""
    nc = declared
    js = nc.jetstream()
    # The marker lives a second in production; long enough here that it is surely there.
    stream = f"KV_{names.LEASES_BUCKET}"
    config = (await js.stream_info(stream)).config
    await js.update_stream(replace(config, subject_delete_marker_ttl=60.0))
    a, b = Lease(js, "run3", "a", ttl_s=1), Lease(js, "run3", "b", ttl_s=30)
    assert await a.acquire()

    async def marker() -> int | None:
        msg = await js.get_last_msg(stream, f"$KV.{names.LEASES_BUCKET}.run3")
        return msg.seq if (msg.headers or {}).get("Nats-Marker-Reason") == "MaxAge" else None

    seq = await eventually(marker, 10, "the expiry marker")
    assert not await is_held(js, "run3")
    assert await b.acquire(), "a create must name the marker's revision"
    assert b.token > seq > a.token
    assert not await a.renew()
