"""The HTTP plumbing of the dashboard's routes: the listening socket (`bind`), the hosts it
answers to (`hosts_for`), Server-Sent-Event responses and where a reconnecting browser left
off, and errors as JSON with the status they deserve."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from baton.client.errors import CliError
from baton.ui import params
from baton.ui.guard import Hosts
from baton.ui.live import with_keepalive
from shared.errors import BatonError

log = logging.getLogger("baton.ui")

def last_id(request: Request) -> int | None:
    """The last summary a reconnecting browser saw: its `Last-Event-ID` (an id we sent; one
    that is not is ignored, since a browser told 400 would stop reconnecting) or `since`."""
    if "since" in request.query_params:
        return params.integer(request.query_params, "since", 0, 0, params.MAX_SEQ)
    raw = request.headers.get("last-event-id", "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 19 else None


def event_stream(source: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        with_keepalive(source),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


STATUS = {2: 400, 3: 404, 4: 403}


async def error_response(request: Request, exc: Exception) -> Response:
    code = STATUS.get(getattr(exc, "code", 1), 500 if not isinstance(exc, BatonError) else 400)
    return JSONResponse({"error": str(exc)}, status_code=code)


async def unavailable_response(request: Request, exc: Exception) -> Response:
    """NATS did not answer (or refused: a missing permission reads as a timeout)."""
    log.warning("%s %s: NATS: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return JSONResponse({"error": f"NATS: {type(exc).__name__}: {exc}"}, status_code=503)


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


def hosts_for(host: str, port: int, allow_hosts: Sequence[str]) -> Hosts:
    """What the dashboard on `host`:`port` answers to; a value that is no host is a usage
    error."""
    try:
        return Hosts.served(host, port, allow_hosts)
    except ValueError as exc:
        raise CliError(f"not a host name to serve on: {exc}", 2) from None


def loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"
