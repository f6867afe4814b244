"""Sites: leaf nodes with their own JetStream domain, and how the hub takes in their work.

A site publishes everything the hub must receive on its own subjects
(`baton.site.<site>.events.…`, see `names.at_site`), captured by the site's outbox stream in
the site's domain — acknowledged there whether or not the WAN link is up. Each hub stream
that needs a kind of message *sources* the outbox, filtered to that kind, with a subject
transform back to the hub's subject (`baton.site.lab1.events.>` → `baton.events.>`). The
hub tracks how far it has sourced, so after any cut every message arrives once and in the
order the site stored it. Hub streams never listen on site subjects: listening and sourcing
at once would store each message twice (docs/nats.md).

After a long cut the hub retries a source on a back-off and catch-up can wait tens of
seconds; re-attaching the source the moment the link is back makes it immediate
(docs/nats.md). The site's checkpointer greets the hub every second (`SiteHello`); the reaper
re-attaches a site's sources on the first greeting after a silence (`link`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ExternalStream, StreamSource, SubjectTransform

from shared.bus import names
from shared.contracts import decode, encode
from shared.contracts.sites import SiteHello, SiteRecord
from shared.errors import ContractError
from shared.state.clock import age, server_now, stamped_values

log = logging.getLogger("baton.sites")

HELLO_EVERY_S = 1.0
SILENCE_S = 3.0
"""No greeting for this long: the link is taken to be down, and the next greeting
re-attaches the site's sources."""

SOURCED = {
    names.EVENTS_STREAM: "events",
    names.LOGS_STREAM: "logs",
    names.DLQ_STREAM: "dlq",
    names.CANCEL_STREAM: "cancel",
    names.TASKS_STREAM: "calls",
    f"KV_{names.WORKERS_BUCKET}": "workers",
    names.REPORTS_STREAM: "reports",
}
"""Hub stream → the kind of site message it takes in. `reports` are not in the outbox: they
are the site's own runs bucket, the records of the runs granted to it, whose newest
revision per run is what the hub takes in (`services/reaper/grants.py`)."""


def api_of(site: str) -> str:
    return f"$JS.{site}.API"


def source_of(site: str, kind: str) -> StreamSource:
    if kind == "reports":
        bucket = names.site_runs_bucket(site)
        return StreamSource(
            name=f"KV_{bucket}",
            external=ExternalStream(api=api_of(site)),
            subject_transforms=[
                SubjectTransform(src=f"$KV.{bucket}.>", dest=f"{names.PREFIX}.reports.{site}.>")
            ],
        )
    dest = f"$KV.{names.WORKERS_BUCKET}.>" if kind == "workers" else f"{names.PREFIX}.{kind}.>"
    return StreamSource(
        name=names.OUTBOX_STREAM,
        external=ExternalStream(api=api_of(site)),
        # The transform's source subject is also the filter: only this kind is copied.
        subject_transforms=[SubjectTransform(src=names.site_root(site, kind), dest=dest)],
    )


def _of(source: StreamSource, site: str) -> bool:
    return source.external is not None and source.external.api == api_of(site)


async def link(js: JetStreamContext, site: str, *, nudge: bool) -> None:
    """Make every hub stream source `site`'s outbox. With `nudge`, a source already there is
    detached and attached again, which makes the hub resume from where it stopped at once
    instead of on its retry back-off."""
    for stream, kind in SOURCED.items():
        config = (await js.stream_info(stream)).config
        others = [s for s in config.sources or [] if not _of(s, site)]
        present = len(others) < len(config.sources or [])
        if present and not nudge:
            continue
        if present:
            await js.update_stream(replace(config, sources=others))
        await js.update_stream(replace(config, sources=[*others, source_of(site, kind)]))


class SiteView(msgspec.Struct, frozen=True, kw_only=True):
    """What `baton sites` shows of one site. Invariant: `link` and `last_seen_s` are read
    off one clock, the hub server's (its stamp of the site's record against its time now):
    the reaper rewrites the record on every greeting, so the stamp is when the hub last
    heard the site, whatever the reaper's, the site's or this host's clock says."""

    site: str
    link: str
    """`up` (greeted within SILENCE_S) or `down`."""
    last_seen_s: float
    """Seconds since the last greeting: the hub server's now less its stamp of the record."""
    heard_at: float = 0.0
    """The hub server's stamp of the site's record (its clock, seconds since the epoch)."""
    backlog: int
    """Messages the hub has yet to source, summed over its streams, as last measured."""
    links: int
    outbox_last_seq: int
    held: int = 0
    """Live runs granted to the site (`baton sites` counts them; 0 where not counted)."""
    held_s: float = 0.0
    """Expected trainer-seconds of those runs still to train (`shared.scheduling.horizon`)."""
    trainers: int = 0
    """Live trainers at the site, as the hub last heard them."""
    horizon_s: float | None = None
    """`held_s` per live trainer: the site's granted horizon; None with none live."""
    unestimated: int = 0
    """Runs held that no measured speed or `estimate_s` says the length of."""


def view_of(r: SiteRecord, heard_at: float, now: float, backlog: int) -> SiteView:
    """One site as shown, from its record, the server's stamp of it and the server's now."""
    seen = age(now, heard_at)
    return SiteView(
        site=r.site, link="up" if seen < SILENCE_S else "down", last_seen_s=seen,
        heard_at=heard_at, backlog=backlog, links=r.links, outbox_last_seq=r.outbox_last_seq,
    )  # fmt: skip


async def views(nc: Client) -> list[SiteView]:
    """Every site the hub has heard of, with its link state and backlog (`nc` is connected
    to the hub). How long ago each was heard is the hub server's to say (`SiteView`)."""
    stored = await stamped_values(nc.jetstream(), names.SITES_BUCKET)
    records = []
    for found in stored:
        with contextlib.suppress(ContractError):  # a newer Baton's record: left out
            records.append((decode(found.value, SiteRecord), found.at))
    lag: dict[str, int] = {}
    for stream in SOURCED:
        for api, state in (await source_states(nc, stream)).items():
            lag[api] = lag.get(api, 0) + state.lag
    now = await server_now(nc, f"KV_{names.SITES_BUCKET}") if records else 0.0
    return [view_of(r, at, now, lag.get(api_of(r.site), 0)) for r, at in records]


async def linked(nc: Client) -> set[str]:
    """The sites that greeted the hub within SILENCE_S, on the hub server's clock (as
    `views`, without the backlog)."""
    stored = await stamped_values(nc.jetstream(), names.SITES_BUCKET)
    if not stored:
        return set()
    now = await server_now(nc, f"KV_{names.SITES_BUCKET}")
    out = set()
    for found in stored:
        with contextlib.suppress(ContractError):
            if age(now, found.at) < SILENCE_S:
                out.add(decode(found.value, SiteRecord).site)
    return out


class SourceState(msgspec.Struct, frozen=True):
    lag: int
    active: bool
    """The hub has a live consumer on the source (the server reports -1 when not)."""


async def source_states(nc: Client, stream: str) -> dict[str, SourceState]:
    """Each external source of a hub stream, by its API prefix. Asked of the server
    directly: nats-py's stream info leaves out which domain a source is in, and every
    site's outbox has the same name."""
    try:
        reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=2)
        info = json.loads(reply.data)
    except (TimeoutError, ValueError, nats.errors.Error):
        return {}
    out = {}
    for src in info.get("sources") or []:
        api = (src.get("external") or {}).get("api")
        if api:
            active = src.get("active", -1) >= 0 and not src.get("error")
            out[api] = SourceState(lag=int(src.get("lag") or 0), active=active)
    return out


def site_of(api: str) -> str:
    """The site whose API prefix `api` is (`$JS.lab1.API` → `lab1`)."""
    return api.removeprefix("$JS.").removesuffix(".API")


async def greet(nc: Client, js_site: JetStreamContext, site: str, stop: asyncio.Event) -> None:
    """Run at the site: say hello to the hub every HELLO_EVERY_S until `stop`. Core NATS:
    a greeting lost to a cut is exactly the silence the hub is meant to notice."""
    while not stop.is_set():
        last = 0
        with contextlib.suppress(Exception):
            last = (await js_site.stream_info(names.OUTBOX_STREAM)).state.last_seq
        hello = SiteHello(site=site, outbox_last_seq=last, at=time.time())
        with contextlib.suppress(Exception):
            await nc.publish(names.hello_subject(site), encode(hello))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HELLO_EVERY_S)
