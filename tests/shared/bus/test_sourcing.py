"""A hub and a leaf site, both real nats-servers in their own JetStream domains: the
cross-domain writes and the sourcing that sites rely on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, NoStreamResponseError

from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions
from baton.stack.servers import nats_server
from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.connect import connect
from shared.bus.kvwrite import KvWriter
from shared.bus.streams import ensure, ensure_site
from shared.contracts import RunRecord, encode
from shared.contracts.jobs import JobSpec
from shared.state.lease import Lease
from shared.state.runs import Runs
from tests.support.stack import eventually

SITE = "lab1"
HUB_API = f"$JS.{names.HUB_DOMAIN}.API"


class Pair:
    def __init__(self, hub: Client, leaf: Client) -> None:
        self.hub = hub
        self.leaf = leaf


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    # Without auth: this is about domains and sourcing (tests/shared/test_auth.py: permissions).
    hub = nats_server(StackOptions(data_dir=tmp_path / "hub", port=0, ws_port=0, auth=False))
    await hub.start()
    servers: list[NatsServer] = [hub]
    clients: list[Client] = []
    try:
        leaf = nats_server(
            StackOptions(
                data_dir=tmp_path / "leaf", port=0, site=SITE, auth=False,
                hub_url=f"ws://127.0.0.1:{hub.ws_port}",
            )
        )  # fmt: skip
        await leaf.start()
        servers.append(leaf)
        for s in servers:
            clients.append(await connect(s.url, "test", first_attempt_timeout=5))
        p = Pair(*clients)
        await ensure(p.hub.jetstream())
        await ensure_site(p.leaf.jetstream(), SITE)

        async def linked() -> bool:
            try:
                await p.leaf.jetstream(domain=names.HUB_DOMAIN).account_info()
            except Exception:
                return False
            return True

        await eventually(linked, 20, "the leaf to join the hub")
        yield p
    finally:
        for c in clients:
            await c.close()
        for s in reversed(servers):
            await s.stop()


def record(run_id: str) -> RunRecord:
    spec = JobSpec(name="t", entry_point="examples.regression:train", total_steps=10)
    return RunRecord(run_id=run_id, spec=spec, spec_hash="x", created_at=0.0, updated_at=0.0)


async def test_kv_writes_from_a_site_need_the_hubs_api_prefix(pair: Pair) -> None:
    hub_kv = await pair.hub.jetstream().key_value(names.LEASES_BUCKET)
    # The trap (docs/nats.md): nats-py's own write from the leaf reaches no stream.
    leaf_kv = await pair.leaf.jetstream(domain=names.HUB_DOMAIN).key_value(names.LEASES_BUCKET)
    with pytest.raises(NoStreamResponseError):
        await leaf_kv.put("plain", b"x")
    writer = KvWriter(pair.leaf.jetstream(), names.LEASES_BUCKET, HUB_API)
    rev = await writer.put("k", b"v1", expected=0, ttl_s=30)
    assert rev is not None and (await hub_kv.get("k")).value == b"v1"
    assert await writer.put("k", b"v2", expected=0) is None, "a create must not overwrite"
    assert await writer.put("k", b"v2", expected=rev) is not None
    assert not await writer.delete("k", expected=rev), "a stale delete must lose"
    entry = await hub_kv.get("k")
    assert entry.revision is not None and await writer.delete("k", expected=entry.revision)
    with pytest.raises(KeyNotFoundError):
        await hub_kv.get("k")


async def test_a_lease_and_a_run_record_across_the_domain_boundary(pair: Pair) -> None:
    hub_js = pair.leaf.jetstream(domain=names.HUB_DOMAIN)
    lease = Lease(hub_js, "r1", "edge", 30, api_prefix=HUB_API)
    rival = Lease(pair.hub.jetstream(), "r1", "hub", 30)
    assert await lease.acquire() and lease.token > 0
    assert not await rival.acquire(), "held at the hub, by the site's write"
    assert await lease.renew()
    await lease.release()
    assert await rival.acquire() and rival.token > lease.token, "fencing tokens only grow"

    hub_runs = await Runs.open(pair.hub.jetstream())
    assert await hub_runs.create(record("r2"))
    site_runs = await Runs.open(hub_js, HUB_API)

    def bump(r: RunRecord) -> RunRecord:
        return RunRecord(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "step": r.step + 1})

    for _ in range(3):
        await site_runs.update("r2", bump)
    found = await hub_runs.get("r2")
    assert found is not None and found[0].step == 3


async def test_the_hub_stores_each_site_message_once_whatever_the_link(pair: Pair) -> None:
    js = pair.hub.jetstream()
    await sites.link(js, SITE, nudge=False)
    await sites.link(js, SITE, nudge=False)  # idempotent: still one source per stream
    await sites.link(js, SITE, nudge=True)  # re-attached, still one
    for stream in sites.SOURCED:
        srcs = (await js.stream_info(stream)).config.sources or []
        assert len(srcs) == 1, f"{stream}: {srcs}"
    await ensure(js)  # declaring the streams again keeps the sources
    assert (await js.stream_info(names.EVENTS_STREAM)).config.sources
    leaf_js = pair.leaf.jetstream()
    for i in range(20):
        subject = names.at_site(names.event_subject("r3", f"k{i}"), SITE)
        await leaf_js.publish(subject, encode({"i": i}))

    async def arrived() -> list[str] | None:
        info = await js.stream_info(names.EVENTS_STREAM, subjects_filter=names.events_of_run("r3"))
        return list(info.state.subjects or {}) if info.state.messages >= 20 else None

    await eventually(arrived, 20, "the site's events at the hub")
    info = await js.stream_info(names.EVENTS_STREAM)
    assert info.state.messages == 20, "stored once each: the hub never listens on site subjects"
    got = [json.loads((await js.get_msg(names.EVENTS_STREAM, s)).data or b"{}")["i"]
           for s in range(info.state.first_seq, info.state.last_seq + 1)]  # fmt: skip
    assert got == list(range(20)), "in the order the site stored them"


async def test_heartbeats_from_a_site_land_in_the_workers_bucket_and_expire(pair: Pair) -> None:
    js = pair.hub.jetstream()
    await sites.link(js, SITE, nudge=False)
    await pair.leaf.jetstream().publish(
        names.heartbeat_subject("edge-1", SITE), b"{}", headers={"Nats-TTL": "2s"}
    )
    kv = await js.key_value(names.WORKERS_BUCKET)

    async def present() -> bool:
        try:
            return (await kv.get("edge-1")).value == b"{}"
        except KeyNotFoundError:
            return False

    async def gone() -> bool:
        return not await present()

    await eventually(present, 20, "the heartbeat at the hub")
    await eventually(gone, 10, "the heartbeat to expire by its TTL")


def test_site_subjects() -> None:
    assert names.at_site("baton.events.r.k", "") == "baton.events.r.k"
    assert names.at_site("baton.events.r.k", "lab1") == "baton.site.lab1.events.r.k"
    assert names.heartbeat_subject("w", "") == f"$KV.{names.WORKERS_BUCKET}.w"
    assert sites.site_of(sites.api_of("lab1")) == "lab1"
