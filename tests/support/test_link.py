"""The shaped link does what it promises, checked against plain loopback servers.

Every time bound here is a lower bound (a delay at least this long, a rate at most this
high): a loaded machine only makes a link slower, so none of them can fail for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator

import pytest

from tests.support.link import MBIT, Flapper, Link, Wire
from tests.support.stack import eventually

WITHIN_S = 10.0


class Server:
    """Echoes (or, as a sink, swallows) what it receives; records when each byte came."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.port = 0
        self.received = 0
        self.last_at = 0.0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                self.last_at = time.monotonic()
                self.received += len(data)
                if self.echo:
                    writer.write(data)
                    await writer.drain()
        writer.close()


async def _serving(echo: bool) -> AsyncIterator[Server]:
    s = Server(echo)
    server = await asyncio.start_server(s.serve, "127.0.0.1", 0)
    s.port = server.sockets[0].getsockname()[1]
    try:
        yield s
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def echo() -> AsyncIterator[Server]:
    async for s in _serving(echo=True):
        yield s


@pytest.fixture
async def sink() -> AsyncIterator[Server]:
    async for s in _serving(echo=False):
        yield s


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def dial(link: Link) -> Conn:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", link.port), WITHIN_S)


async def round_trip(conn: Conn, payload: bytes) -> float:
    reader, writer = conn
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), WITHIN_S)
    assert got == payload, "echoed other bytes"
    return time.monotonic() - started


async def test_each_way_is_delayed_with_jitter(echo: Server) -> None:
    delay, jitter = 0.05, 0.02
    async with Link("127.0.0.1", echo.port, delay_s=delay, jitter_s=jitter, seed=1) as link:
        conn = await dial(link)
        rtts = [await round_trip(conn, b"ping %d" % i) for i in range(20)]
    assert min(rtts) >= 2 * (delay - jitter), f"a round trip beat the delay: {min(rtts):.3f}s"
    # The jitter averages out: 20 round trips of two uniform draws each.
    assert statistics.mean(rtts) >= 2 * delay - 0.01, f"mean {statistics.mean(rtts):.3f}s"
    assert max(rtts) - min(rtts) >= jitter / 2, f"no jitter seen: {min(rtts)}..{max(rtts)}"


@pytest.mark.parametrize("rate", [None, 4 * MBIT], ids=["jitter", "jitter+cap"])
async def test_jitter_never_reorders_bytes(echo: Server, rate: float | None) -> None:
    # Jitter as large as the delay: without the max() rule, pieces would overtake each other.
    async with Link("127.0.0.1", echo.port, delay_s=0.02, jitter_s=0.02, rate=rate) as link:
        reader, writer = await dial(link)
        sent = b"".join(i.to_bytes(4, "big") for i in range(100_000))

        async def send() -> None:
            for i in range(0, len(sent), 1000):
                writer.write(sent[i : i + 1000])
                await writer.drain()

        sending = asyncio.create_task(send())
        got = await asyncio.wait_for(reader.readexactly(len(sent)), 60)
        await sending
    assert got == sent, "bytes arrived out of order"


@pytest.mark.parametrize("up", [True, False], ids=["up", "down"])
async def test_a_cap_holds_throughput_to_the_rate(echo: Server, sink: Server, up: bool) -> None:
    rate, size = 2 * MBIT, 400_000
    # Up: into a sink, capped towards it. Down: an echo, capped only on the way back.
    target, wire = (sink, Wire(rate))
    if not up:
        target = echo
    async with Link(
        "127.0.0.1", target.port, up=wire if up else None, down=None if up else wire
    ) as link:
        reader, writer = await dial(link)

        async def send() -> None:
            writer.write(b"x" * size)
            await writer.drain()

        started = time.monotonic()
        sending = asyncio.create_task(send())
        if up:
            await eventually(lambda: _true(sink.received >= size), 60, "the sink to get it all")
            elapsed, got = sink.last_at - started, sink.received
        else:
            got = len(await asyncio.wait_for(reader.readexactly(size), 60))
            elapsed = time.monotonic() - started
        await sending
        writer.close()
    assert got == size and wire.sent >= size
    # The wire was idle when the first byte was sent: the cap holds from there to the last.
    assert got <= rate * elapsed + wire.quantum, f"{got / elapsed / MBIT:.2f} Mbit/s > 2"


async def test_links_sharing_a_wire_share_its_rate(sink: Server) -> None:
    rate, size = 2 * MBIT, 200_000
    wire = Wire(rate)
    async with (
        Link("127.0.0.1", sink.port, up=wire) as a,
        Link("127.0.0.1", sink.port, up=wire) as b,
    ):
        started = time.monotonic()
        for link in (a, b):
            _, writer = await dial(link)
            writer.write(b"y" * size)
        await eventually(lambda: _true(sink.received >= 2 * size), 60, "both uploads")
        elapsed = sink.last_at - started
    assert 2 * size <= rate * elapsed + 2 * wire.quantum, f"{2 * size / elapsed / MBIT:.2f}"
    assert wire.sent == 2 * size and a.delivered[True] == b.delivered[True] == size


async def test_connections_are_counted(echo: Server) -> None:
    async with Link("127.0.0.1", echo.port) as link:
        for i in range(3):
            await round_trip(await dial(link), b"hello %d" % i)
        assert (link.accepted, link.refused) == (3, 0)
        link.sever()
        reader, _ = await dial(link)
        with contextlib.suppress(ConnectionError):
            assert await reader.read(1) == b"", "a severed link let a dial through"
        await eventually(lambda: _true(link.refused == 1), WITHIN_S, "the dial to be refused")
        link.restore()
        await round_trip(await dial(link), b"again")
        assert (link.accepted, link.refused) == (4, 1)


async def test_flaps_follow_the_schedule_and_wait_for_the_check(echo: Server) -> None:
    checked: list[int] = []

    async def after_restore(n: int) -> None:
        # Runs while the link is up; the next flap waits for it.
        assert not link._severed(), "severed during the check"
        await round_trip(await dial(link), b"after flap %d" % n)
        checked.append(n)

    async with Link("127.0.0.1", echo.port) as link:
        conn = await dial(link)
        await round_trip(conn, b"before")
        flapper = Flapper(
            link, up_s=(0.2, 0.4), down_s=(0.1, 0.2), seed=5, after_restore=after_restore
        )
        async with flapper:
            await eventually(lambda: _true(len(checked) >= 3), 30, "three flaps and checks")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await round_trip(conn, b"a flap reset the first connection")
        await round_trip(await dial(link), b"restored when stopped")
    assert checked[:3] == [1, 2, 3], checked
    assert flapper.flaps >= 3
    for severed, restored in flapper.cuts:
        assert restored - severed >= 0.1, f"a cut shorter than the schedule: {flapper.cuts}"
    # One connection before, one per check, one after; the rest of the dials were refused
    # or none were made: a reconnect is counted once.
    # A check cut short by the stop may have dialled without being counted in `checked`.
    assert 2 + len(checked) <= link.accepted <= 3 + len(checked), (link.accepted, checked)


async def test_a_failing_check_stops_the_flapping_and_is_raised(echo: Server) -> None:
    async def after_restore(n: int) -> None:
        raise RuntimeError(f"check {n} failed")

    async with Link("127.0.0.1", echo.port) as link:
        flapper = Flapper(link, up_s=(0.05, 0.1), down_s=(0.05, 0.1), after_restore=after_restore)
        flapper.start()
        await eventually(lambda: _true(flapper.flaps >= 1), 10, "a flap")
        await eventually(lambda: _true(flapper._task is not None and flapper._task.done()), 10,
                         "the flapping to stop")  # fmt: skip
        with pytest.raises(RuntimeError, match="check 1 failed"):
            await flapper.stop()
        assert not link._severed(), "stop() must leave the link restored"
        await round_trip(await dial(link), b"up")


async def _true(value: bool) -> bool:
    return value
