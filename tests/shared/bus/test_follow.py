"""A follower of a KV bucket whose server came back having lost the unsynced tail of its
streams (a host crash): the bucket's sequences went back, and the writes that reuse them
must still reach the follower (`shared.bus.follow`). Before, the watch resumed past them,
and the scheduler, following the runs bucket, never saw a run submitted again after the
loss: it stayed QUEUED with every trainer idle (found by the fault campaign, seed 1 of the
single-node hub, tests/e2e/test_campaign_single.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from nats.aio.client import Client
from nats.js.kv import KeyValue

from baton.stack.natsserver import NatsServer
from shared.bus.follow import Following
from tests.support.stack import eventually


async def test_a_follower_sees_the_writes_after_its_bucket_went_back(
    nats_server: NatsServer, nc: Client, tmp_path: Path
) -> None:
    js = nc.jetstream()
    kv = await js.create_key_value(bucket="things")
    await kv.put("a", b"1")
    seen: dict[str, bytes] = {}
    resets: list[dict[str, bytes]] = []

    def entry(e: KeyValue.Entry) -> None:
        assert e.value is not None
        seen[e.key] = e.value

    def reset() -> None:
        resets.append(dict(seen))
        seen.clear()

    follower = Following(js, "things", entry, reset)
    await follower.start()
    try:
        await asyncio.wait_for(follower.ready.wait(), 10)
        # The store as it is now; then writes that the server will lose.
        await nats_server.stop()
        copy = tmp_path / "copy"
        shutil.copytree(nats_server.store_dir, copy)
        await nats_server.start()
        await kv.put("b", b"2")
        await kv.put("b", b"3")

        async def heard(key: str, value: bytes) -> bool:
            return seen.get(key) == value

        await eventually(lambda: heard("b", b"3"), 20, "the writes before the loss")
        await nats_server.kill()
        shutil.rmtree(nats_server.store_dir)
        shutil.copytree(copy, nats_server.store_dir)
        await nats_server.start()

        # A write after the loss takes a sequence the follower saw once already.
        async def put() -> bool:
            try:
                await kv.put("c", b"4")
            except Exception:
                return False
            return True

        await eventually(put, 20, "a write after the loss")
        await eventually(lambda: heard("c", b"4"), 20, "the write after the loss")
        assert resets, "the follower started over"
        # What it holds is what the bucket holds: "b" was lost with the tail.
        await eventually(lambda: heard("a", b"1"), 20, "the values held now")
        assert "b" not in seen, seen
    finally:
        await follower.stop()
