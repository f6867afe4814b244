"""Following a bucket through a hub that came back without its newest writes
(`shared.bus.follow`): on a real nats-server whose store is put back to an earlier copy."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from baton.stack.natsserver import NatsServer
from shared.bus import follow
from shared.bus.connect import connect
from shared.bus.follow import Following
from tests.support.stack import eventually


async def test_a_bucket_that_went_back_is_followed_again(nats_server: NatsServer) -> None:
    nc = await connect(nats_server.url, "test", first_attempt_timeout=5)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket="b", history=1))
        seen: dict[str, bytes] = {}
        resets: list[int] = []

        def on_entry(entry: KeyValue.Entry) -> None:
            assert entry.value is not None
            seen[entry.key] = entry.value

        following = Following(js, "b", on_entry, on_reset=lambda: resets.append(1))
        for key in ("a", "b"):
            await kv.put(key, b"kept")
        await following.start()
        await following.ready.wait()
        assert not await following.check(), "a bucket as followed has not gone back"

        # The hub's store as it is now; then writes it will lose.
        await nats_server.stop()
        copy = nats_server.data_dir.parent / "copy"
        shutil.copytree(nats_server.store_dir, copy)
        await nats_server.start()
        await eventually(lambda: _answers(nc), 10, "the client to reconnect")
        assert not await following.check(), "a restart alone loses nothing"
        for i in range(5):
            await kv.put(f"lost{i}", b"lost")
        await eventually(lambda: _has(seen, "lost4"), 10, "the writes to be followed")
        await nats_server.kill()
        shutil.rmtree(nats_server.store_dir)
        shutil.copytree(copy, nats_server.store_dir)
        await nats_server.start()

        await eventually(lambda: _answers(nc), 10, "the client to reconnect")
        await kv.put("new", b"after")  # at a sequence the watch had passed
        assert await following.check(), "the bucket went back: it is followed again"
        assert resets == [1], resets
        await eventually(lambda: _has(seen, "new"), 10, "a write after the loss to be followed")
        await following.stop()
    finally:
        await nc.close()


async def _has(seen: dict[str, bytes], key: str) -> bool:
    return key in seen


async def _answers(nc: object) -> bool:
    await asyncio.sleep(0)
    return bool(getattr(nc, "is_connected", False))


async def test_a_watch_fallen_silent_is_followed_again(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch whose reset failed is deaf for good (nats-py's activity check ends on the
    error): the guard finds the bucket past what was handed over, twice in a row, and
    follows it again — the writes made while it was deaf arrive."""
    monkeypatch.setattr(follow, "GUARD_S", 0.2)
    nc = await connect(nats_server.url, "test", first_attempt_timeout=5)
    following: Following | None = None
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket="deaf", history=1))
        seen: dict[str, bytes] = {}

        def on_entry(entry: KeyValue.Entry) -> None:
            assert entry.value is not None
            seen[entry.key] = entry.value

        following = Following(js, "deaf", on_entry)
        await following.start()
        await following.ready.wait()
        assert following._task is not None
        following._task.cancel()  # deaf, as a watch whose reset failed: no error, no word
        await kv.put("a", b"while deaf")
        await kv.delete("gone")

        async def heard() -> bool:
            return seen.get("a") == b"while deaf"

        await eventually(heard, 10, "the write made while the watch was deaf")
    finally:
        if following is not None:
            await following.close()
        await nc.close()
