"""Sites cut off: told once when the silence passes the threshold, once when the site is
back, across the notifier's restart — against a real nats-server (the sites bucket written
as the reaper writes it on each greeting) and a real HTTP receiver."""

from __future__ import annotations

import time
from pathlib import Path

from nats.aio.client import Client

from services.notifier.sites import check_every, judge
from shared.bus import names
from shared.contracts import encode
from shared.contracts.sites import SiteRecord
from tests.services.notifier.test_service import alerts_for, notifier, receiving
from tests.support.roles import AuthorizedHub


async def greet(nc: Client, site: str) -> None:
    """One greeting, as the reaper records it: the site's record rewritten."""
    kv = await nc.jetstream().key_value(names.SITES_BUCKET)
    now = time.time()
    record = SiteRecord(site=site, first_seen=now, last_hello=now, linked_at=now)
    await kv.put(site, encode(record))


def test_judge_fires_once_per_silence_and_resolves_on_a_newer_greeting() -> None:
    assert judge(None, "lab1", heard=100.0, now=150.0, cut_off_s=60) is None
    fired = judge(None, "lab1", heard=100.0, now=161.0, cut_off_s=60)
    assert fired is not None and (fired.episode, fired.status) == (1, "firing")
    assert judge(fired, "lab1", heard=100.0, now=500.0, cut_off_s=60) is None  # still silent
    back = judge(fired, "lab1", heard=510.0, now=511.0, cut_off_s=60)
    assert back is not None and (back.status, back.back_at) == ("resolved", 510.0)
    assert judge(back, "lab1", heard=510.0, now=520.0, cut_off_s=60) is None
    again = judge(back, "lab1", heard=510.0, now=600.0, cut_off_s=60)
    assert again is not None and (again.episode, again.status) == (2, "firing")
    assert check_every(300) == 15 and check_every(2) == 1 and check_every(20) == 5


async def test_a_silent_site_is_told_once_then_resolved_once(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    operator = await authorized.connect("operator")
    async with receiving() as rx:
        alerts = alerts_for(
            tmp_path,
            f"""
            [sites]
            cut_off_s = 2
            [[pools."*".webhooks]]
            url = "{rx.url("/pool")}"
            kinds = ["failed"]
            [[sites.webhooks]]
            url = "{rx.url("/sites")}"
            """,
        )

        def told(key: str) -> int:
            return rx.got("/sites", lambda b: b["id"] == key)

        # (That a site greeting within its threshold is left alone is `judge`'s, above:
        # here it would hold only while this machine kept the greetings on time.)
        await greet(operator, "lab2")
        async with notifier(authorized, alerts):
            await rx.wait(lambda: told("s.lab2.1.firing") == 1, "lab2's cut-off")
            await greet(operator, "lab2")
            await rx.wait(lambda: told("s.lab2.1.resolved") == 1, "lab2 back")
        # Restarted, the notifier tells neither again; lab2 silent again is a new cut-off.
        async with notifier(authorized, alerts):
            await rx.wait(lambda: told("s.lab2.2.firing") == 1, "lab2's second cut-off")
        assert [r.body["id"] for r in rx.requests] == [
            "s.lab2.1.firing", "s.lab2.1.resolved", "s.lab2.2.firing",
        ]  # fmt: skip
        resolved = rx.requests[1].body
        assert resolved["status"] == "resolved" and resolved["site"] == "lab2"
        assert resolved["kind"] == "site_cut_off" and "is back after" in resolved["summary"]
        assert resolved["event"]["back_at"] > resolved["event"]["last_heard"]
