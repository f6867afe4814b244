"""Dead letters on the dashboard, a page at a time, against a real nats-server: a page holds
its size and costs the page (never the stream), its cursor walks every letter once, oldest
first, skipping letters replayed meanwhile; the page's parameters are checked; a followed
page is sent again when a letter lands on it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from baton.ui.params import LETTERS_PAGE, MAX_LETTERS_PAGE
from shared.bus import names
from shared.bus.answer import post_letter
from shared.contracts import JobSpec, convert, encode
from tests.support.dashboard import events, get, request, served

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
HANG_S = 60.0
"""Only against a hang: how long a pushed page may take to come."""


async def poison(nc: Client, first: int, count: int) -> None:
    """`count` submissions the dispatcher gave up on, stored one after another."""
    js = nc.jetstream()
    for i in range(first, first + count):
        await post_letter(
            js, names.SUBMIT_STREAM, source="dispatcher", subject=names.submit_subject("p"),
            reason=f"poison {i:04d}", payload=encode(SPEC), headers={}, stream_seq=i,
            delivered=10,
        )  # fmt: skip


async def reads(url: str) -> int:
    return int((await get(f"{url}api/meta"))["reads"])


async def test_a_page_holds_its_size_costs_the_page_and_the_cursor_walks_every_letter(
    declared: Client, tmp_path: Path
) -> None:
    await poison(declared, 1, 120)
    async with served(declared, f"file://{tmp_path}/store") as url:
        before = await reads(url)
        reply = await request(url, "/api/dlq")
        cost = await reads(url) - before  # asking for the count reads nothing from NATS
        assert reply.status == 200, reply
        first = reply.json()
        assert first["total"] == 120, first["total"]
        assert [x["reason"] for x in first["letters"]] == [
            f"poison {i:04d}" for i in range(1, LETTERS_PAGE + 1)
        ]
        assert first["next"] == first["letters"][-1]["seq"]
        # The page, not the stream: its stream info, its letters and one more to know of a
        # next page; and what is sent is the page (120 letters were ~5 times as much).
        assert cost == 1 + LETTERS_PAGE + 1, cost
        assert len(reply.body) < 25 * 2_000, len(reply.body)

        second = await get(f"{url}api/dlq?after={first['next']}")
        assert [x["reason"] for x in second["letters"]] == [
            f"poison {i:04d}" for i in range(LETTERS_PAGE + 1, 2 * LETTERS_PAGE + 1)
        ]

        # Replay (delete) every other letter of the second page and the third: the pages
        # skip them, still full, at the same cost.
        gone = [x["seq"] for x in second["letters"]][::2]
        gone += [second["letters"][-1]["seq"] + k for k in range(1, 2 * LETTERS_PAGE, 2)]
        for seq in gone:
            await declared.jetstream().delete_msg(names.DLQ_STREAM, seq)
        before = await reads(url)
        again = await get(f"{url}api/dlq?after={first['next']}")
        assert await reads(url) - before == 1 + LETTERS_PAGE + 1
        assert len(again["letters"]) == LETTERS_PAGE
        assert not {x["seq"] for x in again["letters"]} & set(gone)
        assert again["total"] == 120 - len(gone)

        # Every letter left, once, oldest first, whatever the page size.
        for limit in (1, 7, MAX_LETTERS_PAGE):
            seen: list[int] = []
            after = 0
            while True:
                page = await get(f"{url}api/dlq?after={after}&limit={limit}")
                assert len(page["letters"]) <= limit
                seen += [x["seq"] for x in page["letters"]]
                if page["next"] is None:
                    break
                assert len(page["letters"]) == limit
                after = page["next"]
            assert seen == sorted(set(range(1, 121)) - set(gone)), (limit, seen)


async def test_the_page_parameters_are_checked(declared: Client, tmp_path: Path) -> None:
    async with served(declared, f"file://{tmp_path}/store") as url:
        for query in (
            "limit=0", f"limit={MAX_LETTERS_PAGE + 1}", "limit=abc", "limit=-1", "after=-1",
            "after=abc", f"after={'9' * 25}", "after=1.5", "after=%3E",
        ):  # fmt: skip
            for path in ("/api/dlq", "/api/dlq/live"):
                reply = await request(url, f"{path}?{query}")
                assert reply.status == 400, (path, query, reply)
                assert reply.json()["error"], (path, query)
        empty = await get(f"{url}api/dlq?after=5&limit={MAX_LETTERS_PAGE}")
        assert (empty["letters"], empty["next"], empty["total"]) == ([], None, 0), empty


async def test_a_followed_page_is_sent_again_when_a_letter_lands_on_it(
    declared: Client, tmp_path: Path
) -> None:
    await poison(declared, 1, 3)
    async with served(declared, f"file://{tmp_path}/store") as url:
        stream = events(url, "/api/dlq/live?limit=5")

        async def view() -> Any:
            async for kind, data in stream:
                if kind == "view":
                    return data
            raise AssertionError("the live stream ended")

        try:
            shown = await asyncio.wait_for(view(), HANG_S)
            assert [x["reason"] for x in shown["letters"]] == [f"poison 000{i}" for i in (1, 2, 3)]
            await poison(declared, 4, 1)
            shown = await asyncio.wait_for(view(), HANG_S)
            assert len(shown["letters"]) == 4 and shown["total"] == 4, json.dumps(shown)[:400]
        finally:
            await stream.aclose()
