"""The dashboard's runs list against a real nats-server: a page costs the page, never the
history; pages walk the whole history newest first; a browser that reconnects to the live
stream is sent exactly what changed since the last change it saw."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path

import msgspec
from nats.aio.client import Client

from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.state import archive
from shared.state.runs import Runs
from tests.support.dashboard import get, served
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)


async def history(runs: Runs, start: int, count: int) -> None:
    """`count` finished runs, created one millisecond apart from `start`."""
    base = 1_700_000_000.0
    for i in range(start, start + count):
        at = base + i / 1000
        record = RunRecord(
            run_id=f"r{i:05d}", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=at,
            updated_at=at, state=RunState.COMPLETED, step=5,
        )  # fmt: skip
        assert await runs.create(record)


async def cost(nc: Client, url: str) -> tuple[int, int]:
    """What loading the first page of 10 made the dashboard read: its own count of reads, and
    the messages its NATS connection received meanwhile (so no read can hide)."""
    reads, received = (await get(f"{url}api/meta"))["reads"], nc.stats["in_msgs"]
    await get(f"{url}api/runs?limit=10")
    return (await get(f"{url}api/meta"))["reads"] - reads, nc.stats["in_msgs"] - received


async def test_the_first_page_costs_the_same_with_10_or_1000_runs_of_history(
    declared: Client, tmp_path: Path
) -> None:
    runs = await Runs.open(declared.jetstream())
    await history(runs, 0, 10)
    async with served(declared, f"file://{tmp_path}/store") as url:
        cost_at_10 = await cost(declared, url)
        page = await get(f"{url}api/runs?limit=10")
        assert [r["run_id"] for r in page["runs"]] == [f"r{i:05d}" for i in range(9, -1, -1)]

        await history(runs, 10, 990)

        async def indexed() -> bool:
            return bool((await get(f"{url}api/meta"))["runs"] == 1000)

        await eventually(indexed, 30, "the dashboard to see 1,000 runs")
        cost_at_1000 = await cost(declared, url)
        page = await get(f"{url}api/runs?limit=10")
        assert [r["run_id"] for r in page["runs"]] == [f"r{i:05d}" for i in range(999, 989, -1)]
        assert page["total"] == 1000
        assert cost_at_1000 == cost_at_10, "a page must cost the page, not the history"

        # The cursors walk the whole history, newest first, each run once.
        seen: list[str] = []
        after = ""
        while True:
            page = await get(f"{url}api/runs?limit=200{after}")
            seen += [r["run_id"] for r in page["runs"]]
            if page["next"] is None:
                break
            after = f"&after={page['next']}"
        assert seen == [f"r{i:05d}" for i in range(999, -1, -1)]
        # Filters apply before the page is cut.
        failed = await get(f"{url}api/runs?state=FAILED")
        assert failed["runs"] == []

        # A run retired long ago (archived, gone from the runs bucket) still has its page.
        at = 1_600_000_000.0
        old = RunRecord(
            run_id="rarchived", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=at,
            updated_at=at, state=RunState.FAILED, step=3, reason="lost",
        )  # fmt: skip
        await archive.keep(declared.jetstream(), old)
        assert await runs.get("rarchived") is None
        shown = await get(f"{url}api/runs/rarchived")
        assert shown["record"]["state"] == "FAILED", shown


async def sse_lines(url: str, last_id: int | None) -> AsyncGenerator[str, None]:
    host, _, _ = url.removeprefix("http://").partition("/")
    name, _, port = host.partition(":")
    reader, writer = await asyncio.open_connection(name, int(port))
    head = f"Last-Event-ID: {last_id}\r\n" if last_id is not None else ""
    writer.write(f"GET /api/live HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
    await writer.drain()
    try:
        while line := await reader.readline():
            yield line.decode().rstrip("\r\n")
    finally:
        writer.close()


async def test_a_reconnecting_browser_is_sent_what_changed_since_its_last_event(
    declared: Client, tmp_path: Path
) -> None:
    runs = await Runs.open(declared.jetstream())
    await history(runs, 0, 3)
    async with served(declared, f"file://{tmp_path}/store") as url:
        page = await get(f"{url}api/runs")
        newest_seen = max(r["seq"] for r in page["runs"])
        # While the browser was away: one run changed, one was created.
        await runs.update("r00001", lambda r: msgspec.structs.replace(r, state=RunState.FAILED))
        await history(runs, 3, 1)

        async def changed() -> bool:
            return bool((await get(f"{url}api/meta"))["runs"] == 4)

        await eventually(changed, 30, "the dashboard to see the new run")
        got: list[dict[str, object]] = []
        ids: list[int] = []
        lines = sse_lines(url, newest_seen)
        async for line in lines:
            if line.startswith("id: "):
                ids.append(int(line[4:]))
            if line.startswith("data: ") and '"run_id"' in line:
                got.append(json.loads(line[6:]))
                if len(got) == 2:
                    break
        await lines.aclose()
        assert [(r["run_id"], r["state"]) for r in got] == [
            ("r00001", "FAILED"), ("r00003", "COMPLETED"),
        ]  # fmt: skip
        assert all(i > newest_seen for i in ids)
        assert [r["total"] for r in got] == [4, 4], "each pushed change carries the count"
