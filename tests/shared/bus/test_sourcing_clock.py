"""`baton sites`' ages are the hub's: how long ago a site was heard is the server's now less
its stamp of the site's record (the reaper rewrites it on every greeting), never a time the
record holds against this host's clock."""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client

from shared.bus import names
from shared.bus.sourcing import SILENCE_S, view_of, views
from shared.contracts import encode
from shared.contracts.sites import SiteRecord
from shared.state.clock import server_now, stamped_values

SKEW = 300.0


def site(name: str, at: float) -> SiteRecord:
    return SiteRecord(site=name, first_seen=at, last_hello=at, linked_at=at, links=2)


def test_a_sites_age_and_link_come_from_the_hubs_stamp_and_now_alone() -> None:
    now = 1_800_000_000.0
    for written in (now - SKEW, now + SKEW, 0.0):  # the reaper's clock, whatever it says
        up = view_of(site("lab1", written), heard_at=now - 1.0, now=now, backlog=7)
        assert (up.link, up.last_seen_s, up.heard_at) == ("up", 1.0, now - 1.0)
        assert (up.backlog, up.links) == (7, 2)
        down = view_of(site("lab1", written), heard_at=now - SILENCE_S - 1, now=now, backlog=0)
        assert down.link == "down" and down.last_seen_s == pytest.approx(SILENCE_S + 1)
    # A stamp a clustered hub's other node put a hair ahead of this one's now: not negative.
    assert view_of(site("lab1", now), heard_at=now + 0.2, now=now, backlog=0).last_seen_s == 0


async def test_sites_written_5_minutes_off_were_heard_just_now(declared: Client) -> None:
    kv = await declared.jetstream().key_value(names.SITES_BUCKET)
    assert await views(declared) == []
    for name, off in (("ahead", SKEW), ("behind", -SKEW), ("gone", 0.0)):
        await kv.put(name, encode(site(name, time.time() + off)))
    await kv.delete("gone")
    stamped = await stamped_values(declared.jetstream(), names.SITES_BUCKET)
    now = await server_now(declared, f"KV_{names.SITES_BUCKET}")
    assert [s.key for s in stamped] == ["ahead", "behind"]
    assert all(0 <= now - s.at < 60 for s in stamped)
    shown = await views(declared)
    assert [v.site for v in shown] == ["ahead", "behind"]
    assert all(0 <= v.last_seen_s < 60 for v in shown), shown
