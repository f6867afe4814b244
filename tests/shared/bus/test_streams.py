"""Stream definitions applied to a real server: created, updated, or refused loudly."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, RetentionPolicy, StreamConfig

from shared.bus import names
from shared.bus.streams import ensure, stream_configs
from shared.errors import ConfigError


async def test_ensure_is_idempotent_and_creates_everything(nc: Client) -> None:
    js = nc.jetstream()
    await ensure(js)
    await ensure(js)
    for config in stream_configs():
        assert config.name is not None
        assert (await js.stream_info(config.name)).config.subjects == config.subjects
    assert (await js.key_value(names.LEASES_BUCKET)) is not None


async def test_a_stale_definition_is_updated(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(name=names.EVENTS_STREAM, subjects=[names.EVENTS_ALL], max_age=60.0)
    )
    await ensure(js)
    assert (await js.stream_info(names.EVENTS_STREAM)).config.max_age == 30 * 86400


async def test_a_definition_that_cannot_be_updated_fails_loudly(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=names.TASKS_STREAM, subjects=[names.TASKS_ALL], retention=RetentionPolicy.LIMITS
        )
    )
    with pytest.raises(ConfigError, match="retention"):
        await ensure(js)


async def test_a_bucket_without_per_key_ttl_fails_loudly(nc: Client) -> None:
    js = nc.jetstream()
    await js.create_key_value(KeyValueConfig(bucket=names.RUNS_BUCKET, history=5))
    await js.create_key_value(KeyValueConfig(bucket=names.LEASES_BUCKET, history=3))
    with pytest.raises(ConfigError, match=names.LEASES_BUCKET):
        await ensure(js)
