"""`baton ui`: the operator's dashboard, served by uvicorn from this package.

Starlette and uvicorn, because the dashboard is a handful of JSON routes and three
Server-Sent-Event streams next to a NATS connection on one event loop: an ASGI toolkit and
server made for exactly that, with no framework or build step around them. The page and its
one charting library (uPlot, `static/vendor/`) are served from the package, so it works
offline and behind any firewall.

Reads come from the streams and buckets Baton already has (`index`, `views`, `live`) and
the scheduler's answers for a pool's queue (`queue`); the
only writes are an operator's actions — replaying a dead letter and pinning a checkpoint
here, steering a run, forking it and draining a trainer in `actions` — each a POST route
made by `guard.action`: it must come from the dashboard's own page
(`guard`: its Origin) and carry the page's token (`X-Baton-Token`), which another site's page
cannot read; a refusal says why (no token, or a stale one: the page is older than this
dashboard) for the page to show. Every
request must name a host the dashboard is served on (`guard`: no DNS rebinding), and every
value taken from a URL is checked before it reaches NATS or the store (`params`). It logs
in to NATS as the `dashboard` role (`shared.auth`): reads, replay, steering and drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from typing import Any

import uvicorn
from nats.aio.client import Client
from nats.errors import Error as NatsError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from baton.client import calls as client
from baton.client import inspect
from baton.client.errors import CliError
from baton.client.inspect import as_json
from baton.ui import fleet, params, views
from baton.ui.actions import Actions
from baton.ui.guard import Guard, Hosts, action
from baton.ui.index import MAX_PAGE, Filter, RunIndex
from baton.ui.live import Fanout, Heartbeats, sse
from baton.ui.queue import Queues
from baton.ui.web import (
    bind,
    error_response,
    event_stream,
    hosts_for,
    last_id,
    unavailable_response,
)
from shared.auth import DASHBOARD_REPLAYS
from shared.bus import names
from shared.errors import BatonError
from shared.state.clock import ServerClock

log = logging.getLogger("baton.ui")

STATIC = resources.files("baton.ui") / "static"
VIEW_EVERY_S = 0.5
"""A run page is sent a fresh view at most this often while events pour in."""
INDEX_TIMEOUT_S = 30.0


class Dashboard:
    """One dashboard: reads for its pages, the actions, and the page's token (made at each
    start, so a page served by an earlier dashboard cannot act on this one)."""

    def __init__(self, nc: Client, store_url: str | None) -> None:
        self.nc = nc
        self.store_url = store_url
        self.token = secrets.token_urlsafe(24)
        self.reads = views.Reads()
        self.goodputs = views.Goodputs(nc, self.reads)
        self.fanout = Fanout()
        # The hub's clock, which every age a page shows is read from (docs: "Clocks").
        self.clock = ServerClock(nc, f"KV_{names.RUNS_BUCKET}")
        self.index = RunIndex(nc.jetstream(), self.fanout, self.clock)
        self.beats = Heartbeats(nc.jetstream(), self.fanout, self.clock)
        self.sites_seen = fleet.SiteRecords(nc, self.clock, self.reads)
        self.queues = Queues(nc, self.reads, lambda: {s.pool for s in self.index.runs.values()})
        self.actions = Actions(nc, store_url)
        self.guard: Guard | None = None

    async def start(self) -> None:
        runs, beats, sites = self.index.following, self.beats.following, self.sites_seen.following
        try:
            await self.clock.sync()
            await runs.start()
            await asyncio.wait_for(runs.ready.wait(), INDEX_TIMEOUT_S)
            await beats.start()
            await sites.start()
            await asyncio.wait_for(sites.ready.wait(), INDEX_TIMEOUT_S)
        except (NatsError, TimeoutError, RuntimeError) as exc:
            await self.stop()
            raise CliError(
                f"cannot follow the runs and workers buckets ({type(exc).__name__}: {exc}); "
                "the dashboard needs the dashboard's or the operator's credentials "
                "(--auth-file, --creds or NATS_USER/NATS_PASSWORD; `baton up` writes "
                ".baton/auth/dashboard.env)"
            ) from None

    async def stop(self) -> None:
        await self.queues.stop()
        await self.sites_seen.following.close()
        await self.beats.following.close()
        await self.index.following.close()

    def app(self, hosts: Hosts) -> Guard:
        """The routes, behind the Host and Origin checks of `guard`."""
        self.guard = Guard(self._routes(), hosts)
        return self.guard

    def _routes(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/", self.page),
                Route("/api/meta", self.meta),
                Route("/api/runs", self.runs),
                Route("/api/goodput", self.goodput),
                Route("/api/live", self.live),
                Route("/api/runs/{run_id}", self.run),
                Route("/api/runs/{run_id}/live", self.run_live),
                Route("/api/runs/{run_id}/logs", self.logs),
                Route("/api/runs/{run_id}/checkpoints", self.checkpoints),
                action("/api/runs/{run_id}/checkpoints/{step}/pin", self.pin, self.token),
                Route("/api/workers", self.workers),
                Route("/api/sites", self.sites),
                Route("/api/sites/live", self.sites_live),
                Route("/api/streams", self.streams),
                Route("/api/streams/live", self.streams_live),
                Route("/api/dlq", self.letters),
                Route("/api/dlq/live", self.letters_live),
                action("/api/dlq/{seq}/replay", self.replay, self.token),
                *self.queues.routes(),  # a pool's queue, and its live stream
                *self.actions.routes(self.token),  # steering runs, draining trainers
                Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
            ],
            exception_handlers={
                BatonError: error_response, CliError: error_response,
                NatsError: unavailable_response, TimeoutError: unavailable_response,
            },
        )  # fmt: skip

    # -- pages and lists ------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        body = (STATIC / "index.html").read_text(encoding="utf-8")
        # The page holds the token: no cache keeps a copy of it.
        headers = {"Cache-Control": "no-store"}
        return HTMLResponse(body.replace("{{token}}", self.token), headers=headers)

    async def meta(self, request: Request) -> Response:
        return JSONResponse({
            "reads": self.reads.count, "runs": len(self.index.runs),
            "following": self.fanout.following, "dropped": self.fanout.dropped,
            "refused": self.guard.refused if self.guard is not None else 0,
        })  # fmt: skip

    async def runs(self, request: Request) -> Response:
        q = request.query_params
        where = Filter(
            state=params.state(q.get("state", "")), pool=q.get("pool", ""),
            owner=q.get("owner", ""), site=q.get("site", ""),
        )  # fmt: skip
        limit = params.integer(q, "limit", 50, 1, MAX_PAGE)
        page = self.index.page(where, params.cursor(q.get("after")), limit)
        return JSONResponse({
            "runs": as_json(page.runs), "next": page.next, "total": page.total,
            "now": self.clock.now(),  # carried, not asked: a page costs the page alone
        })  # fmt: skip

    async def goodput(self, request: Request) -> Response:
        """Goodput of the finished runs named in `runs` (comma-separated, at most a page):
        the list asks for its rows' once it has shown them, so a page costs its rows."""
        wanted = [r for r in request.query_params.get("runs", "").split(",") if r][:MAX_PAGE]
        finished = [r for r in wanted if (s := self.index.runs.get(r)) and s.state.terminal]
        found = await asyncio.gather(*(self.goodputs.of(r) for r in finished))
        return JSONResponse(dict(zip(finished, found, strict=True)))

    async def live(self, request: Request) -> Response:
        """Run summaries as they change, and heartbeats. A browser that reconnects names the
        last summary it saw (`Last-Event-ID`) and is sent every change since first."""
        last = last_id(request)

        async def stream() -> AsyncIterator[str]:
            async with self.fanout.follow() as queue:
                yield "retry: 1000\n\n"
                if last is not None:
                    for s in self.index.since(last):
                        yield sse("run", self.index.shown(s), s.seq)
                # None: this browser fell `LIVE_QUEUE_MAX` behind and was dropped; the end of
                # the stream makes it reconnect, and re-read from its last id.
                while (message := await queue.get()) is not None:
                    yield message

        return event_stream(stream())

    # -- one run ---------------------------------------------------------------------------

    async def run(self, request: Request) -> Response:
        run_id = params.run_id(request.path_params["run_id"])
        record = await self._record(run_id)
        async with views.RunEvents(self.nc, run_id, self.reads) as history:
            return JSONResponse(await self._view(record, history))

    async def run_live(self, request: Request) -> Response:
        """The run's page, sent again whenever new events arrived (at most every
        `VIEW_EVERY_S`): one place computes a run's timeline, and the browser only draws."""
        run_id = params.run_id(request.path_params["run_id"])
        await self._record(run_id)  # 404 before the stream starts

        async def stream() -> AsyncIterator[str]:
            async with views.RunEvents(self.nc, run_id, self.reads) as history:
                while True:
                    record = await self._record(run_id)
                    yield sse("view", await self._view(record, history))
                    await history.more(timeout=3600)
                    await asyncio.sleep(VIEW_EVERY_S)  # coalesce a burst into one view
                    await history.more(timeout=0.01)

        return event_stream(stream())

    async def logs(self, request: Request) -> Response:
        """The run's output from the start, then live; 404 for a run that does not exist
        (in the runs bucket or the archive) before anything is streamed."""
        run_id = params.run_id(request.path_params["run_id"])
        await self._record(run_id)

        async def stream() -> AsyncIterator[str]:
            async for text in views.log_tail(self.nc, run_id, self.reads):
                yield sse("log", text)

        return event_stream(stream())

    async def checkpoints(self, request: Request) -> Response:
        run_id = params.run_id(request.path_params["run_id"])
        rows = await inspect.checkpoints(self._store(), run_id)
        return JSONResponse(as_json(rows))

    async def pin(self, request: Request) -> Response:
        run_id = params.run_id(request.path_params["run_id"])
        step = params.number(request.path_params["step"], "step", low=0)
        await inspect.pin(self._store(), run_id, step)
        return JSONResponse({"pinned": step})

    # -- the fleet ---------------------------------------------------------------------------

    async def workers(self, request: Request) -> Response:
        return JSONResponse(await views.workers(self.nc, self.reads, await self.clock.read()))

    async def sites(self, request: Request) -> Response:
        return JSONResponse(await self.sites_seen.views())

    async def sites_live(self, request: Request) -> Response:
        async def read() -> dict[str, Any]:
            return {"sites": await self.sites_seen.views()}

        return event_stream(fleet.refreshing(read))

    async def streams(self, request: Request) -> Response:
        return JSONResponse(await views.streams(self.nc, self.reads))

    async def streams_live(self, request: Request) -> Response:
        async def read() -> dict[str, Any]:
            return {"streams": await views.streams(self.nc, self.reads)}

        return event_stream(fleet.refreshing(read))

    async def letters(self, request: Request) -> Response:
        """A page of dead letters (`views.letters`): `after`, the cursor a page's `next`
        gave, and `limit`, the page's size, both checked (`params`)."""
        after, limit = params.letters_page(request.query_params)
        now = await self.clock.read()
        return JSONResponse(await views.letters(self.nc, self.reads, now, after, limit))

    async def letters_live(self, request: Request) -> Response:
        after, limit = params.letters_page(request.query_params)

        async def read() -> dict[str, Any]:
            now = await self.clock.read()
            return await views.letters(self.nc, self.reads, now, after, limit)

        return event_stream(fleet.refreshing(read))

    async def replay(self, request: Request) -> Response:
        """Publish a dead letter again to its work queue, and remove it. Only to the hub's
        work queues (`DASHBOARD_REPLAYS`, all the dashboard role may publish to)."""
        seq = params.number(request.path_params["seq"], "seq")
        subject = (await inspect.dlq_show(self.nc, seq)).letter.subject
        if not replayable(subject):
            raise params.bad(
                f"dead letter #{seq} was bound for {subject}, not a hub work queue: the "
                "dashboard does not replay it (`baton dlq replay`, as an operator, does)"
            )
        subject = await inspect.dlq_replay(self.nc, seq)
        return JSONResponse({"replayed": seq, "subject": subject})

    # -- helpers -----------------------------------------------------------------------------

    async def _view(self, record: Any, history: views.RunEvents) -> dict[str, Any]:
        now = await self.clock.read()
        return views.run_view(record, history.events, history.stamps, history.seq, now)

    async def _record(self, run_id: str) -> Any:
        record = await views.run_record(self.nc, run_id, self.reads)
        if record is None:
            raise CliError(f"no run {run_id!r}", 3)
        return record

    def _store(self) -> str:
        if self.store_url is None:
            raise CliError(
                "no checkpoint store given, and the hub does not say: start `baton ui` with"
                " --store",
                2,
            )
        return self.store_url


def replayable(subject: str) -> bool:
    return any(subject.startswith(root.removesuffix(">")) for root in DASHBOARD_REPLAYS)


async def serve(
    nc: Client,
    store_url: str | None,
    host: str,
    port: int,
    ready: Callable[[str], None],
    allow_hosts: Sequence[str] = (),
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's handlers only set its exit flag), answering
    only requests for `host`, the loopback names and `allow_hosts` (`guard.Hosts`)."""
    hosts_for(host, 1, allow_hosts)
    if store_url is None:  # none given: where the hub says (`shared.state.hub`), if it says
        with contextlib.suppress(Exception):  # the store is for the checkpoints' pages only
            store_url = await client.hub_store(nc)
    dash = Dashboard(nc, store_url)
    await dash.start()
    sock = bind(host, port)
    try:
        hosts = hosts_for(host, sock.getsockname()[1], allow_hosts)
        config = uvicorn.Config(
            dash.app(hosts), log_level="warning", lifespan="off",
            # Live streams never end by themselves: give browsers a second, then close.
            timeout_graceful_shutdown=1,
        )  # fmt: skip
        server = uvicorn.Server(config)
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        ready(f"http://{shown}:{bound[1]}/")
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        await dash.stop()
