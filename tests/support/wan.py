"""A hub and one site joined by links a test can degrade: the leaf's WebSocket link to the
hub and the site's way to the object store (a real SeaweedFS) each cross a `Link`.

Only the site crosses them: the hub's services reach the store directly, as a hub next to
its store would, while the site's checkpointer, trainer and training processes reach it
through the store link (`BATON_S3_ENDPOINT` is the link's address). Both links start
clean; a test shapes them (`Link.shape`) after whatever it wants measured on a clean link.

`open_wan` stops everything it started, also when the test fails: the hub `Stack` owns the
site's processes, leaf node and both links (its `after_services`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.bus import sourcing as sites
from tests.support.link import Link
from tests.support.seaweed import SeaweedS3
from tests.support.sites import SOURCED as SOURCE_HEADER
from tests.support.sites import Site
from tests.support.stack import Stack

HUB_ONLY = ("dispatcher", "checkpointer", "reaper")


@dataclass
class Wan:
    hub: Stack
    site: Site
    leaf: Link
    """The leaf node's link to the hub's WebSocket (`site.proxy`)."""
    store: Link
    """The site's link to the object store."""
    store_url: str


@contextlib.asynccontextmanager
async def open_wan(
    root: Path,
    seaweed: SeaweedS3,
    *,
    site: str = "lab1",
    lease_ttl: int = 8,
    site_env: dict[str, str] | None = None,
    trainers: int = 1,
) -> AsyncIterator[Wan]:
    """A hub (dispatcher, checkpointer, reaper) and a site with `trainers`, on an S3 store;
    `site_env` is laid over the site's services' environment (`BATON_UPLOAD_BPS`…)."""
    store_url = seaweed.url(f"wan-{uuid.uuid4().hex[:10]}")
    hub = Stack(
        root / "hub", trainers=0, lease_ttl=lease_ttl,
        env={**seaweed.env(), "BATON_STORE": store_url},
    )  # fmt: skip
    try:
        await hub.start(HUB_ONLY)
        store = Link("127.0.0.1", seaweed.ports["s3"], seed=2)
        await store.start()
        hub.after_services.append(store.stop)
        s = Site(hub, site)
        s.proxy = leaf = Link("127.0.0.1", hub.ws_port, seed=1)
        env = {**s.opts.extra_env, "BATON_S3_ENDPOINT": store.endpoint, **(site_env or {})}
        s.opts = msgspec.structs.replace(s.opts, extra_env=env)
        await s.start(trainers=trainers)
        yield Wan(hub, s, leaf, store, store_url)
    finally:
        await hub.stop()


def _hub_subject(site: str, kind: str, subject: str) -> str:
    """Where the hub's source puts an outbox message (`sites.source_of`'s transform)."""
    rest = subject.removeprefix(names.site_root(site, kind)[:-1])
    if kind == "workers":
        return f"$KV.{names.WORKERS_BUCKET}.{rest}"
    return f"{names.PREFIX}.{kind}.{rest}"


def _source_seq(headers: dict[str, str] | None) -> int | None:
    """The outbox sequence a hub message was sourced from (`Nats-Stream-Source`:
    `<stream> <seq> <filter> <transform>`), None for the hub's own messages."""
    value = (headers or {}).get(SOURCE_HEADER)
    if not value:
        return None
    parts = value.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


async def undrained(w: Wan, hub_nc: Client, site_nc: Client) -> list[str]:
    """Kinds of the site's outbox whose newest message the hub does not hold yet, empty
    when the outbox is drained. The hub sources each kind in the outbox's order, so holding
    a kind's newest message means holding every earlier one of that kind too."""
    site_js, hub_js = site_nc.jetstream(), hub_nc.jetstream()
    behind = []
    for stream, kind in sites.SOURCED.items():
        try:
            last = await site_js.get_last_msg(
                names.OUTBOX_STREAM, names.site_root(w.site.name, kind)
            )
        except NotFoundError:
            continue  # the site never sent this kind
        try:
            subject = _hub_subject(w.site.name, kind, last.subject or "")
            at_hub = await hub_js.get_last_msg(stream, subject)
        except NotFoundError:
            behind.append(kind)
            continue
        seq = _source_seq(at_hub.headers)
        if seq is None or seq < (last.seq or 0):
            behind.append(kind)
    return behind
