"""The dashboard's rules, without a server: which hosts and origins it answers, which URL
values it takes, and that a browser left behind costs a bounded queue."""

from __future__ import annotations

import asyncio

import pytest
from starlette.datastructures import QueryParams

from baton.client.errors import CliError
from baton.ui import params
from baton.ui.guard import Hosts, same_origin, split_host
from baton.ui.live import Fanout
from shared.auth import DASHBOARD_REPLAYS, dashboard_permissions, hub_permissions
from shared.bus import names


def test_loopback_names_with_the_served_port_and_nothing_else_by_default() -> None:
    hosts = Hosts.served("127.0.0.1", 8650)
    for ok in ("127.0.0.1:8650", "localhost:8650", "LOCALHOST:8650", "[::1]:8650"):
        assert hosts.admits(ok), ok
    for no in (
        "evil.example:8650", "evil.example", "127.0.0.1:8651", "127.0.0.1", "localhost",
        "10.0.0.1:8650", "", "localhost:8650@evil.example", "[::1", "127.0.0.1:x",
        "localhost.:8650", "localhost:8650/",
    ):  # fmt: skip
        assert not hosts.admits(no), no


def test_the_bound_address_and_allowed_names_are_added() -> None:
    hosts = Hosts.served("10.1.2.3", 8650, ["gpu-box.lan", "proxy.example:443", "::1"])
    assert hosts.admits("10.1.2.3:8650")
    assert hosts.admits("gpu-box.lan:8650") and hosts.admits("gpu-box.lan")
    assert hosts.admits("proxy.example:443") and not hosts.admits("proxy.example:8650")
    assert not hosts.admits("proxy.example")
    assert not hosts.admits("10.1.2.4:8650")
    assert Hosts.served("::1", 9000).admits("[::1]:9000")


def test_bound_to_every_address_any_ip_literal_but_no_other_name() -> None:
    """An IP literal cannot be rebound by DNS; a name can."""
    hosts = Hosts.served("0.0.0.0", 8650)
    assert hosts.admits("192.168.7.7:8650") and hosts.admits("[fe80::1]:8650")
    assert not hosts.admits("192.168.7.7:8651")
    assert not hosts.admits("evil.example:8650")
    assert hosts.admits("localhost:8650")


def test_host_values_that_are_not_hosts_are_refused() -> None:
    for bad in ("", "a/b", "x@y", "[nope]:1", "h:0", "h:70000", "h:12ab"):
        with pytest.raises(ValueError):
            split_host(bad)


def test_an_action_must_come_from_the_dashboards_own_origin() -> None:
    hosts = Hosts.served("127.0.0.1", 8650)
    host = "127.0.0.1:8650"
    assert same_origin("http://127.0.0.1:8650", host, hosts)
    assert same_origin("http://localhost:8650", host, hosts)  # a name it answers to
    for no in (
        None, "", "null", "http://evil.example:8650", "http://evil.example",
        "http://127.0.0.1:8651", "file://", "http://127.0.0.1:8650/path",
        "javascript:alert(1)",
    ):  # fmt: skip
        assert not same_origin(no, host, hosts), no
    behind_tls = Hosts.served("127.0.0.1", 8650, ["baton.example"])
    assert same_origin("https://baton.example", "baton.example", behind_tls)


def test_run_ids_and_numbers_from_urls_are_checked() -> None:
    assert params.run_id("alice.r0123abc") == "alice.r0123abc"
    for bad in (">", "*", "a.>", "a.*", "a.b.c", "", "a b", "a/b", "x" * 65, "é"):
        with pytest.raises(CliError) as refused:
            params.run_id(bad)
        assert refused.value.code == params.BAD_REQUEST
    q = QueryParams("limit=abc&a=0&b=201&c=25&d=%C2%B2&e=-1&f=99999999999999999999999")
    assert params.integer(q, "limit_absent", 50, 1, 200) == 50
    assert params.integer(q, "c", 50, 1, 200) == 25
    for name in ("limit", "a", "b", "d", "e", "f"):
        with pytest.raises(CliError):
            params.integer(q, name, 50, 1, 200)
    assert params.cursor("1700000000.5:r00001") == (1700000000.5, "r00001")
    for bad_cursor in ("abc", "1.5", "nan:r1", "inf:r1", "1.5:>", "1.5:a.*"):
        with pytest.raises(CliError):
            params.cursor(bad_cursor)
    assert params.number("7", "seq") == 7
    for bad_number in ("0", "-1", "1e3", "9" * 30, "٣"):
        with pytest.raises(CliError):
            params.number(bad_number, "seq")
    assert params.state("failed") == "failed"
    with pytest.raises(CliError):
        params.state("exploded")


async def test_a_browser_that_falls_behind_is_dropped_and_its_queue_emptied() -> None:
    fanout = Fanout(limit=5)
    async with fanout.follow() as slow, fanout.follow() as quick:
        for i in range(5):
            fanout.publish("run", {"i": i}, i)
            assert await quick.get() is not None  # one that keeps up stays
        assert slow.qsize() == 5 and fanout.following == 2
        fanout.publish("run", {"i": 5}, 5)  # one more than the slow one's queue holds
        assert fanout.dropped == 1 and fanout.following == 1
        assert slow.qsize() == 1 and slow.get_nowait() is None  # the end of its stream
        for i in range(6, 100):  # the rest go to the quick one only
            fanout.publish("run", {"i": i}, i)
            assert await quick.get() is not None
        assert slow.qsize() == 0
    assert fanout.following == 0


async def test_the_live_stream_of_a_dropped_browser_ends() -> None:
    """What the route does with the queue: it ends the response, so the browser
    reconnects (and names its last id)."""
    fanout = Fanout(limit=2)
    got: list[str] = []
    following, took, stalled = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def browser() -> None:
        async with fanout.follow() as queue:
            following.set()
            while (message := await queue.get()) is not None:
                got.append(message)
                took.set()
                await stalled.wait()  # a browser that stops reading

    reader = asyncio.create_task(browser())
    await following.wait()
    fanout.publish("run", {"i": 0}, 0)
    await took.wait()
    for i in range(1, 4):  # two fill its queue, the third is one too many
        fanout.publish("run", {"i": i}, i)
    assert fanout.dropped == 1
    stalled.set()
    await reader  # the stream ended by itself
    assert len(got) == 1


def test_the_dashboard_role_may_publish_only_reads_replays_steering_and_drains() -> None:
    perms = hub_permissions("dashboard")
    assert perms == dashboard_permissions()
    assert perms.subscribe == ("_INBOX_dashboard.>",)
    outside_the_api = [s for s in perms.publish if not s.startswith("$JS.")]
    drains = f"$KV.{names.DRAINS_BUCKET}.>"
    # The queue page asks the scheduler for a pool's queue (core request and reply).
    wanted = [*DASHBOARD_REPLAYS, names.STEER_ALL, drains, names.QUEUE_ALL]
    assert sorted(outside_the_api) == sorted(wanted)
    assert not [s for s in outside_the_api if s.startswith(f"{names.PREFIX}.control.")]
    kv = [s for s in perms.publish if s.startswith("$KV.")]
    assert kv == [drains], "no record or lease write: the drains bucket alone"
    allowed_verbs = ("STREAM.INFO.", "STREAM.MSG.GET.", "DIRECT.GET.", "CONSUMER.")
    for s in perms.publish:
        if s.startswith("$JS.API."):
            verb = s.removeprefix("$JS.API.")
            assert verb.startswith(allowed_verbs) or verb == "STREAM.MSG.DELETE.BATON_DLQ", s
            assert not verb.startswith(("CONSUMER.DURABLE.", "CONSUMER.MSG.")), s
