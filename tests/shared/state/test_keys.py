"""Listing a bucket's keys, against a real nats-server: the message-by-message read that
checks nats-py's "no keys" sees exactly the keys with a value — not those deleted, purged
or expired — and an empty bucket is empty."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from shared.bus.kvwrite import KvWriter
from shared.state.keys import keys, read_keys
from tests.support.stack import eventually

BUCKET = "probe_keys"


async def test_the_read_sees_what_has_a_value_now(nc: Client) -> None:
    js = nc.jetstream()
    kv = await js.create_key_value(
        KeyValueConfig(bucket=BUCKET, history=1, limit_marker_ttl=1)
    )
    assert await read_keys(js, BUCKET) == [] and await keys(js, BUCKET) == []
    for k in ("a", "b", "c", "d", "e"):
        await kv.put(k, b"v")
    await kv.put("b", b"again")
    await kv.delete("c")
    await kv.purge("d")
    writer = KvWriter(js, BUCKET)
    assert await writer.put("short", b"v", ttl_s=1) is not None

    async def expired() -> bool:  # its TTL ran out on the server's clock
        return "short" not in await read_keys(js, BUCKET)

    await eventually(expired, 15, "the key with a TTL to expire")
    got = sorted(await read_keys(js, BUCKET))
    assert got == ["a", "b", "e"], got
    assert sorted(await keys(js, BUCKET)) == got


@pytest.mark.parametrize("n", [1, 200])
async def test_the_read_ends_at_the_last_key(nc: Client, n: int) -> None:
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1))
    for i in range(n):
        await kv.put(f"k{i:04d}", b"v")
    assert sorted(await read_keys(js, BUCKET)) == [f"k{i:04d}" for i in range(n)]
