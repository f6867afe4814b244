"""The checkpointer: the only writer of manifests and `latest` pointers.

Whatever a trainer claims about its files is checked here by reading them back; the
protocol itself is `shared.checkpoint.commit`. A refused commit (a fenced worker's, or one
whose files are damaged) is not retried: the trainer learns of it from the `commit_refused` event.

A request naming a `base` is a rollback or a fork's graft (`shared.checkpoint.rebase`): its
outcome is a `rolled_back` or `forked` event, its refusal a `commit_refused` as any commit's.

Each commit is a `checkpoint.commit` span (verify, manifest, pointer CAS, outcome event),
the child of the trainer's `commit` span whose context the request's headers carry.
Retention runs after the span: it is housekeeping, not part of what a commit costs.

At a site (`BATON_SITE`) the checkpointer serves that site's trainers from the site's own
JetStream — commits go on while the WAN link is down, as long as the store is reachable —
and its events reach the hub through the site's outbox. It also declares the site's streams
and greets the hub every second (`shared.bus.sourcing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace

from shared import telemetry
from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.answer import handle
from shared.bus.emit import emit
from shared.bus.service import pull_loop
from shared.bus.streams import (
    checkpointer_consumer,
    declared,
    ensure,
    ensure_consumer,
    ensure_site,
)
from shared.checkpoint import commit, rebase, retention
from shared.checkpoint.store import Store, open_store
from shared.config import Settings
from shared.contracts import CommitRequest, decode
from shared.contracts.events import CheckpointCommitted, CommitRefused, kind_of
from shared.errors import ContractError, IntegrityError, StaleToken
from shared.state import hub

log = logging.getLogger("baton.checkpointer")

PROGRESS_EVERY_S = 10.0


class Checkpointer:
    def __init__(self, nc: Client, settings: Settings, store: Store | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.store = store or open_store(settings.store_url)
        self.site = settings.site
        self.replicas = settings.replicas
        self.hub_api = settings.hub_api or ""

    async def on_reconnect(self) -> None:
        return None  # pull consumers resume by themselves once NATS is back

    async def close(self) -> None:
        await self.store.close()

    async def start(self) -> None:
        async def declare() -> None:
            if self.site:
                await ensure_site(self.js, self.site, self.hub_api)
            else:
                await ensure(self.js, self.replicas)
            await ensure_consumer(self.js, names.CKPT_STREAM, checkpointer_consumer(self.site))
            if not self.site:  # clients find the store from the hub (`shared.state.hub`)
                await hub.say_store(self.js, hub.store_info(self.store.url))

        await declared(declare, log)

    async def serve(self, stop: asyncio.Event) -> None:
        commits = pull_loop(
            self.js,
            names.CKPT_STREAM,
            names.CHECKPOINTER_CONSUMER,
            stop,
            lambda msg: handle(self.js, msg, "checkpointer", self.on_commit, site=self.site),
        )
        if not self.site:
            await commits
            return
        await asyncio.gather(commits, sites.greet(self.nc, self.js, self.site, stop))

    async def on_commit(self, msg: Msg) -> None:
        with telemetry.tracer.start_as_current_span(
            "checkpoint.commit",
            context=telemetry.extract(msg.headers),
            kind=trace.SpanKind.CONSUMER,
        ) as span:
            req = await self._commit(msg, span)
        if req is None:
            return
        # Only now, with a newer commit durable, may older checkpoints go.
        try:
            pinned = await retention.pins(self.store, req.run_id)
            await retention.apply_retention(self.store, req.run_id, req.keep_last, pinned)
        except Exception:  # retention is housekeeping: the next commit tries again
            log.exception("retention for %s failed; will retry after the next commit", req.run_id)

    async def _commit(self, msg: Msg, span: trace.Span) -> CommitRequest | None:
        """Verify and commit; the request on success. A refusal raises (after its event),
        except a fenced one, which returns None."""
        req = decode(msg.data, CommitRequest)
        span.set_attributes(
            {telemetry.RUN_ID: req.run_id, telemetry.TOKEN: req.token, telemetry.STEP: req.step}
        )
        try:
            side = side_of(req, self.site)
            async with _in_progress(msg):
                if req.base is not None:
                    rebased = await rebase.rebase(self.store, req, side)
                else:
                    pointer, size = await commit.commit(self.store, req, side)
        except (StaleToken, IntegrityError) as exc:
            log.warning("refused %s step %d token %d: %s", req.run_id, req.step, req.token, exc)
            refused = CommitRefused(
                run_id=req.run_id, step=req.step, token=req.token, reason=str(exc)
            )
            await emit(
                self.js,
                refused,
                msg_id=f"refused.{req.run_id}.{req.token}.{req.step}",
                site=self.site,
            )
            span.set_attribute(telemetry.OUTCOME, "refused")
            if isinstance(exc, StaleToken):
                span.set_status(trace.StatusCode.ERROR, str(exc))
                return None  # expected behaviour of the protocol, not a poison message
            raise
        if req.base is not None:
            told = rebased.event()
            msg_id = f"{kind_of(told)}.{req.run_id}.{req.token}"
            await emit(self.js, told, msg_id=msg_id, site=self.site)
            log.info("%s %s to step %d under token %d", kind_of(told), req.run_id, req.step,
                     req.token)  # fmt: skip
            span.set_attribute(telemetry.OUTCOME, kind_of(told))
            return req
        await emit(
            self.js,
            CheckpointCommitted(
                run_id=req.run_id,
                step=req.step,
                token=req.token,
                manifest=pointer.manifest,
                bytes=size,
                final=req.final,
            ),
            msg_id=f"committed.{req.run_id}.{req.token}.{req.step}",
            site=self.site,
        )
        log.info("committed %s step %d token %d (%d bytes)", req.run_id, req.step, req.token, size)
        span.set_attributes({telemetry.OUTCOME: "committed", "baton.bytes": size})
        return req


def side_of(req: CommitRequest, site: str) -> str:
    """Whose chain `req` extends, written into `latest`, at the checkpointer of `site` (""
    the hub): the attempt's side, which is the checkpointer's own or, at a site, the hub's
    (a hub task a site's trainer took); never another site's."""
    if req.side is None or req.side == site:
        return site
    if site and not req.side:
        return ""
    where = f"site {site}" if site else "the hub"
    raise ContractError(f"a commit for side {req.side!r} sent to the checkpointer of {where}")


@contextlib.asynccontextmanager
async def _in_progress(msg: Msg) -> AsyncIterator[None]:
    """Keep the message ours while verifying large files takes longer than AckWait."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            await msg.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
