"""Stream definitions applied to a real server: created, updated, or refused loudly; and
waited for while a clustered hub has no majority."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, RetentionPolicy, StreamConfig

from shared.bus import names
from shared.bus.connect import connect
from shared.bus.streams import ensure, kv_configs, stream_configs
from shared.errors import ConfigError
from tests.support.stack import eventually


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


async def test_a_hub_that_grew_a_cluster_gets_every_stream_on_three_nodes(tmp_path: Path) -> None:
    """Streams and buckets declared with one copy (a hub before it was clustered) are moved
    to three in place by `ensure(js, 3)`, keeping what they hold."""
    from baton.stack.cluster import HubCluster, current
    from baton.stack.natsconf import ClusterRoutes
    from baton.stack.natsserver import NatsServer

    def node(i: int, routes: ClusterRoutes | None) -> NatsServer:
        return NatsServer(tmp_path / f"n{i}", server_name=f"n{i}", cluster=routes)

    hub = HubCluster(3, node)
    await hub.start()
    try:
        nc = await connect(hub.url, "test", first_attempt_timeout=10)
        try:
            js = nc.jetstream()
            await ensure(js, replicas=1)
            await js.publish(names.archive_subject("r1"), b"kept")
            await ensure(js, replicas=3)
            expected = [c.name for c in stream_configs()]
            expected += [f"KV_{b.bucket}" for b in kv_configs()]

            async def all_on_three() -> bool:
                states = [await current(js, name, 3) for name in expected if name]
                return all(states)

            await eventually(all_on_three, 60, "every stream on three nodes")
            kept = await js.get_last_msg(names.ARCHIVE_STREAM, names.archive_subject("r1"))
            assert kept.data == b"kept"
        finally:
            await nc.close()
    finally:
        await hub.stop()


async def test_a_service_started_without_a_majority_waits_for_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub service whose cluster has too few nodes up — as when it starts with its
    cluster — waits for JetStream to answer instead of exiting on its first request."""
    from baton.stack.cluster import HubCluster
    from baton.stack.natsconf import ClusterRoutes
    from baton.stack.natsserver import NatsServer
    from services.reaper.service import Reaper
    from shared import config

    def node(i: int, routes: ClusterRoutes | None) -> NatsServer:
        return NatsServer(tmp_path / f"n{i}", server_name=f"n{i}", cluster=routes)

    hub = HubCluster(3, node)
    await hub.start()
    try:
        lone, *others = hub.nodes
        nc = await connect(lone.url, "test", first_attempt_timeout=10)
        try:
            await asyncio.gather(*(n.kill() for n in others))
            settings = config.load(
                {"BATON_REPLICAS": "3", "BATON_STORE": f"file://{tmp_path / 'store'}"}
            )
            reaper = Reaper(nc, settings)
            caplog.set_level(logging.WARNING, logger="baton.reaper")
            starting = asyncio.create_task(reaper.start())

            async def waiting() -> bool:
                assert not starting.done() or starting.exception() is None, starting.exception()
                return "JetStream is not answering yet" in caplog.text

            await eventually(waiting, 60, "the reaper to wait for a majority")
            assert not starting.done()
            await asyncio.gather(*(n.start() for n in others))
            await asyncio.wait_for(starting, 120)
            await reaper.close()
            info = await nc.jetstream().stream_info(names.TASKS_STREAM)
            assert info.config.num_replicas == 3
        finally:
            await nc.close()
    finally:
        await hub.stop()


async def test_declarations_wait_out_peers_not_back_yet_and_nothing_else() -> None:
    """10005 ("no suitable peers for placement", while a cluster's nodes come back) is waited
    out like an unanswered request; any other refusal is the caller's at once."""
    from nats.js.errors import BadRequestError

    from shared.bus.streams import declared

    tries: list[int] = []

    async def placement() -> None:
        tries.append(1)
        if len(tries) < 3:
            raise BadRequestError(code=400, err_code=10005, description="peer offline")

    await asyncio.wait_for(declared(placement, logging.getLogger("test")), 30)
    assert len(tries) == 3

    async def invalid() -> None:
        raise BadRequestError(code=400, err_code=10052, description="invalid config")

    with pytest.raises(BadRequestError):
        await asyncio.wait_for(declared(invalid, logging.getLogger("test")), 30)
