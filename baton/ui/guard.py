"""Who the dashboard answers. Invariant: a browser reads from or acts on the dashboard only
through a page the dashboard itself served, on a name it is served on.

* **Host.** A request is answered only when its `Host` is a name the dashboard is served on
  (`Hosts`): the loopback names with the served port, the address it binds, and the names
  given with `--allow-host`. A page of another site whose name was made to resolve to this
  machine (DNS rebinding) is same-origin with that name, so the browser lets it read what it
  fetches — but its requests carry its own name as `Host`, and get no page and no API
  answer (421, a short plain body). An IP literal cannot be rebound, so a dashboard bound to
  every address (`0.0.0.0`, `::`) answers to any IP literal with its port.
* **Origin.** A state-changing request (any method but GET, HEAD, OPTIONS) must carry an
  `Origin` that is this dashboard (the request's own host, or one it answers to); one with
  none or another is refused (403) before any route sees it.
* **Token.** An action's route, made by `action`, runs only for a request that carries the
  page's token (`X-Baton-Token`), which the dashboard makes at each start and only its own
  page holds; without it, or with a stale one, the refusal says which.
* **Headers.** Every response, refusals included, forbids framing (`frame-ancestors
  'none'`, `X-Frame-Options: DENY`) and content sniffing, and its policy lets the page load
  scripts, styles and connections from the dashboard alone.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import msgspec
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
HTTP_PORT = 80

POLICY = (
    "default-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
    # The page sets element styles (bar widths, colours) as attributes.
    "style-src 'self' 'unsafe-inline'; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    ("content-security-policy", POLICY),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cross-origin-resource-policy", "same-origin"),
)


def split_host(value: str) -> tuple[str, int | None]:
    """`name[:port]` as (lower-case name, port or None); an IPv6 address in brackets, as in
    a `Host` header (a bare one is bracketed). ValueError if it is neither."""
    value = value.strip().lower()
    if not value:
        raise ValueError("an empty host")
    if value.startswith("["):
        name, sep, rest = value.partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"not a host: {value!r}")
        ipaddress.IPv6Address(name[1:])
        return name + "]", _port(rest[1:]) if rest else None
    if value.count(":") > 1:  # a bare IPv6 address, as `--host ::1` gives it
        return f"[{ipaddress.IPv6Address(value)}]", None
    name, sep, port = value.partition(":")
    if not name or any(c in name for c in "/\\@?#[] "):
        raise ValueError(f"not a host: {value!r}")
    return name, _port(port) if sep else None


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"not a port: {text!r}")
    return int(text)


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


class Hosts(msgspec.Struct, frozen=True):
    """The `Host` values the dashboard answers to: each `name:port` in `exact`, each name in
    `portless` written without a port (a proxy on the default port), and with `any_ip`
    (bound to every address) any IP literal with the served port."""

    port: int
    exact: frozenset[str]
    portless: frozenset[str] = frozenset()
    any_ip: bool = False

    @classmethod
    def served(cls, bound: str, port: int, allow: Iterable[str] = ()) -> Hosts:
        """The loopback names with `port`, the address `bound` (unless a wildcard), and each
        of `allow` (`name` or `name:port`; a name without a port is also admitted written
        without one). ValueError names a value that is not a host."""
        exact = {f"{n}:{port}" for n in LOOPBACK_NAMES}
        portless = set(LOOPBACK_NAMES) if port == HTTP_PORT else set()
        any_ip = bound.strip().lower() in WILDCARDS
        if not any_ip:
            name, _ = split_host(bound)
            exact.add(f"{name}:{port}")
        for given in allow:
            name, given_port = split_host(given)
            exact.add(f"{name}:{given_port or port}")
            if given_port is None:
                portless.add(name)
        return cls(port=port, exact=frozenset(exact), portless=frozenset(portless), any_ip=any_ip)

    def admits(self, host: str) -> bool:
        try:
            name, port = split_host(host)
        except ValueError:
            return False
        if port is None:
            return name in self.portless or (
                self.any_ip and self.port == HTTP_PORT and _ip_literal(name)
            )
        if f"{name}:{port}" in self.exact:
            return True
        return self.any_ip and port == self.port and _ip_literal(name)

    def names(self) -> list[str]:
        return sorted(self.exact | self.portless)


def same_origin(origin: str | None, host: str, hosts: Hosts) -> bool:
    """`origin` (a request's `Origin`) is this dashboard: the request's own host, or a host
    it answers to, over http or https. None, `null` and anything else are not."""
    if not origin:
        return False
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or parts.path or parts.query or parts.fragment:
        return False
    netloc = parts.netloc.lower()
    return bool(netloc) and (netloc == host.strip().lower() or hosts.admits(netloc))


class Guard:
    """ASGI middleware in front of every route: the Host and Origin checks, and the
    security headers on every response (module docstring)."""

    def __init__(self, app: ASGIApp, hosts: Hosts) -> None:
        self.app = app
        self.hosts = hosts
        self.refused = 0
        """Requests refused for their Host or Origin, since start."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    *(h for h in message.get("headers", []) if h[0] not in _OURS),
                    *((k.encode(), v.encode()) for k, v in SECURITY_HEADERS),
                ]
                message = {**message, "headers": headers}
            await send(message)

        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not self.hosts.admits(host):
            self.refused += 1
            refusal = PlainTextResponse(
                "Misdirected request: this dashboard answers only to the names it is served "
                "on (see `baton ui --allow-host`).\n",
                status_code=421,
            )
            await refusal(scope, receive, secured)
            return
        if scope["method"] not in SAFE_METHODS and not same_origin(
            headers.get("origin"), host, self.hosts
        ):
            self.refused += 1
            forbidden = JSONResponse(
                {"error": "an action must come from the dashboard's own page (Origin)"},
                status_code=403,
            )
            await forbidden(scope, receive, secured)
            return
        await self.app(scope, receive, secured)


_OURS = frozenset(k.encode() for k, _ in SECURITY_HEADERS)


Handler = Callable[[Request], Awaitable[Response]]


def action(path: str, handler: Handler, token: str) -> Route:
    """An operator's action: a POST route (so `Guard` checks its Origin) whose `handler` runs
    only for a request carrying `token`, the page's. Invariant: a request without it, or with
    another — a page served by an earlier start of the dashboard — changes nothing, and is
    answered 403 with the reason and `reload` set, for the page to show (`act` in
    `static/app.js`). Every action's route is made here: adding one is a handler and a line."""
    want = token.encode()

    async def checked(request: Request) -> Response:
        given = request.headers.get("x-baton-token", "")
        if given and secrets.compare_digest(given.encode(errors="replace"), want):
            return await handler(request)
        reason = (
            "this page's token is stale: the dashboard was restarted after the page was "
            "loaded, so it no longer accepts the page's actions — reload the page"
            if given
            else "this action needs the page's token (X-Baton-Token), which the request did "
            "not carry — reload the dashboard's page"
        )
        return JSONResponse({"error": reason, "reload": True}, status_code=403)

    return Route(path, checked, methods=["POST"])
