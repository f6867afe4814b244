"""`baton ui`: the operator's dashboard, served by uvicorn from this package.

Starlette and uvicorn, because the dashboard is a handful of JSON routes and three
Server-Sent-Event streams next to a NATS connection on one event loop: an ASGI toolkit and
server made for exactly that, with no framework or build step around them. The page and its
one charting library (uPlot, `static/vendor/`) are served from the package, so it works
offline and behind any firewall.

Reads come from the streams and buckets Baton already has (`index`, `views`, `live`); the
only writes are an operator's two actions — replaying a dead letter and pinning a
checkpoint — each a POST that must carry the page's token (`X-Baton-Token`), which another
site's page cannot read, so a page elsewhere cannot make the browser act here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

import uvicorn
from nats.aio.client import Client
from nats.errors import Error as NatsError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from baton.cli import inspect
from baton.cli.errors import CliError
from baton.cli.inspect import as_json
from baton.ui import views
from baton.ui.index import MAX_PAGE, Filter, RunIndex
from baton.ui.live import Fanout, Heartbeats, sse, with_keepalive
from shared.errors import BatonError

log = logging.getLogger("baton.ui")

STATIC = resources.files("baton.ui") / "static"
VIEW_EVERY_S = 0.5
"""A run page is sent a fresh view at most this often while events pour in."""
INDEX_TIMEOUT_S = 30.0


class Dashboard:
    def __init__(self, nc: Client, store_url: str | None) -> None:
        self.nc = nc
        self.store_url = store_url
        self.token = secrets.token_urlsafe(24)
        self.reads = views.Reads()
        self.goodputs = views.Goodputs(nc, self.reads)
        self.fanout = Fanout()
        self.index = RunIndex(nc.jetstream(), self.fanout)
        self.beats = Heartbeats(nc.jetstream(), self.fanout)

    async def start(self) -> None:
        runs, beats = self.index.following, self.beats.following
        try:
            await runs.start()
            await asyncio.wait_for(runs.ready.wait(), INDEX_TIMEOUT_S)
            await beats.start()
        except (NatsError, TimeoutError) as exc:
            await self.stop()
            raise CliError(
                f"cannot follow the runs and workers buckets ({type(exc).__name__}: {exc}); "
                "the dashboard needs the operator's credentials (--auth-file, --creds or "
                "NATS_USER/NATS_PASSWORD)"
            ) from None

    async def stop(self) -> None:
        await self.beats.following.stop()
        await self.index.following.stop()

    def app(self) -> Starlette:
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
                Route(
                    "/api/runs/{run_id}/checkpoints/{step:int}/pin", self.pin, methods=["POST"]
                ),
                Route("/api/workers", self.workers),
                Route("/api/sites", self.sites),
                Route("/api/streams", self.streams),
                Route("/api/dlq", self.letters),
                Route("/api/dlq/{seq:int}/replay", self.replay, methods=["POST"]),
                Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
            ],
            exception_handlers={BatonError: _error, CliError: _error},
        )

    # -- pages and lists ------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        body = (STATIC / "index.html").read_text(encoding="utf-8")
        return HTMLResponse(body.replace("{{token}}", self.token))

    async def meta(self, request: Request) -> Response:
        return JSONResponse({"reads": self.reads.count, "runs": len(self.index.runs)})

    async def runs(self, request: Request) -> Response:
        q = request.query_params
        where = Filter(
            state=q.get("state", ""), pool=q.get("pool", ""), owner=q.get("owner", ""),
            site=q.get("site", ""),
        )  # fmt: skip
        page = self.index.page(where, q.get("after"), int(q.get("limit", "50")))
        return JSONResponse(
            {"runs": as_json(page.runs), "next": page.next, "total": page.total}
        )

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
        last = _last_id(request)

        async def stream() -> AsyncIterator[str]:
            async with self.fanout.follow() as queue:
                yield "retry: 1000\n\n"
                if last is not None:
                    for s in self.index.since(last):
                        yield sse("run", as_json(s), s.seq)
                while True:
                    yield await queue.get()

        return _events(stream())

    # -- one run ---------------------------------------------------------------------------

    async def run(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        record = await self._record(run_id)
        async with views.RunEvents(self.nc, run_id, self.reads) as history:
            return JSONResponse(views.run_view(record, history.events, history.seq))

    async def run_live(self, request: Request) -> Response:
        """The run's page, sent again whenever new events arrived (at most every
        `VIEW_EVERY_S`): one place computes a run's timeline, and the browser only draws."""
        run_id = request.path_params["run_id"]
        await self._record(run_id)  # 404 before the stream starts

        async def stream() -> AsyncIterator[str]:
            async with views.RunEvents(self.nc, run_id, self.reads) as history:
                while True:
                    record = await self._record(run_id)
                    yield sse("view", views.run_view(record, history.events, history.seq))
                    await history.more(timeout=3600)
                    await asyncio.sleep(VIEW_EVERY_S)  # coalesce a burst into one view
                    await history.more(timeout=0.01)

        return _events(stream())

    async def logs(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]

        async def stream() -> AsyncIterator[str]:
            async for text in views.log_tail(self.nc, run_id, self.reads):
                yield sse("log", text)

        return _events(stream())

    async def checkpoints(self, request: Request) -> Response:
        rows = await inspect.checkpoints(self._store(), request.path_params["run_id"])
        return JSONResponse(as_json(rows))

    async def pin(self, request: Request) -> Response:
        self._check_token(request)
        run_id, step = request.path_params["run_id"], request.path_params["step"]
        await inspect.pin(self._store(), run_id, step)
        return JSONResponse({"pinned": step})

    # -- the fleet ---------------------------------------------------------------------------

    async def workers(self, request: Request) -> Response:
        return JSONResponse(await views.workers(self.nc, self.reads))

    async def sites(self, request: Request) -> Response:
        return JSONResponse(await views.sites(self.nc, self.reads))

    async def streams(self, request: Request) -> Response:
        return JSONResponse(await views.streams(self.nc, self.reads))

    async def letters(self, request: Request) -> Response:
        return JSONResponse(await views.letters(self.nc, self.reads))

    async def replay(self, request: Request) -> Response:
        self._check_token(request)
        subject = await inspect.dlq_replay(self.nc, request.path_params["seq"])
        return JSONResponse({"replayed": request.path_params["seq"], "subject": subject})

    # -- helpers -----------------------------------------------------------------------------

    async def _record(self, run_id: str) -> Any:
        record = await views.run_record(self.nc, run_id, self.reads)
        if record is None:
            raise CliError(f"no run {run_id!r}", 3)
        return record

    def _store(self) -> str:
        if self.store_url is None:
            raise CliError("no checkpoint store given: start `baton ui` with --store", 2)
        return self.store_url

    def _check_token(self, request: Request) -> None:
        if not secrets.compare_digest(request.headers.get("x-baton-token", ""), self.token):
            raise CliError("this action needs the page's token (reload the dashboard)", 4)


def _last_id(request: Request) -> int | None:
    raw = request.headers.get("last-event-id") or request.query_params.get("since")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def _events(source: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        with_keepalive(source),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


STATUS = {2: 400, 3: 404, 4: 403}


async def _error(request: Request, exc: Exception) -> Response:
    code = STATUS.get(getattr(exc, "code", 1), 500 if not isinstance(exc, BatonError) else 400)
    return JSONResponse({"error": str(exc)}, status_code=code)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts so its port is known (0: any
    free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}", 2) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


async def serve(
    nc: Client, store_url: str | None, host: str, port: int, ready: Callable[[str], None]
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's handlers only set its exit flag)."""
    dash = Dashboard(nc, store_url)
    await dash.start()
    sock = bind(host, port)
    try:
        config = uvicorn.Config(
            dash.app(), log_level="warning", lifespan="off",
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
