"""NATS connections that never give up, and publishes that are safe to retry.

nats-py's defaults stop reconnecting after 60 attempts (~2 minutes) and ping every 120 s,
so a dead link goes unnoticed for minutes (docs/nats.md). A trainer behind a flaky link
must instead reconnect forever and notice a silent partition within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import NoServersError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from shared import credentials
from shared.backoff import Backoff, retrying
from shared.errors import ConfigError
from shared.logs import Condition

log = logging.getLogger("baton.nats")

PING_INTERVAL_S = 3
MAX_OUTSTANDING_PINGS = 2
RECONNECT_WAIT_S = 0.5
DRAIN_TIMEOUT_S = 10.0
"""What a stopping service gives its subscriptions to finish the messages in hand (nats-py:
30 s). Its own work is done by then; this only lets the last acks and events out."""


async def connect(
    url: str,
    name: str,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    first_attempt_timeout: float | None = None,
    options: Mapping[str, Any] | None = None,
    client: Client | None = None,
) -> Client:
    """Connect, retrying the first connection too (a service may start before its server).

    `first_attempt_timeout` bounds that first wait (CLI commands want a prompt error); None
    retries forever, as services do. Credentials come from `options`, else from the
    environment (`shared.credentials.client_options`): never from the URL, which gets logged.
    `client` is the (unconnected) client to connect, when a caller needs its own kind.
    """

    async def disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        log.warning(
            "%s: reconnected to %s", name, nc.connected_url.netloc if nc.connected_url else "?"
        )
        if on_reconnect is not None:
            await on_reconnect()

    async def errored(exc: Exception) -> None:
        if "authorization" in str(exc).lower():
            denied.set()
        log.debug("%s: NATS error: %r", name, exc)

    # nats-py retries a refused login forever when reconnects are unlimited: watch for it,
    # and fail loudly instead of hanging.
    denied = asyncio.Event()
    nc = client if client is not None else Client()
    loop = asyncio.get_running_loop()
    deadline = None if first_attempt_timeout is None else loop.time() + first_attempt_timeout
    delays = Backoff(first=0.2, most=5.0)
    while True:
        creds = {**credentials.client_options(), **(options or {})}
        left = None if deadline is None else max(0.1, deadline - loop.time())
        try:
            # nats-py tries a first connection as long as it would reconnect (for ever,
            # here): a command's wait is bounded by its deadline instead.
            await asyncio.wait_for(_attempt(
                nc,
                url,
                denied,
                creds,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=RECONNECT_WAIT_S,
                ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                connect_timeout=2,
                drain_timeout=DRAIN_TIMEOUT_S,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=errored,
            ), left)  # fmt: skip
            return nc
        except (TimeoutError, NoServersError, OSError) as exc:
            delay = delays.next()
            if deadline is not None and loop.time() + delay > deadline:
                raise await _unreachable(nc, url, exc, first_attempt_timeout) from None
            log.warning(
                "%s: NATS at %s not reachable (%s); retrying", name, url, type(exc).__name__
            )
            await asyncio.sleep(delay)


async def _unreachable(
    nc: Client, url: str, exc: Exception, timeout: float | None
) -> ConnectionError:
    """What a command that could not connect in `timeout` seconds says; an attempt cut short
    by it is stopped first."""
    if not nc.is_closed:
        with contextlib.suppress(Exception):
            await nc.close()
    why = str(exc) or f"no answer in {timeout:g} s"
    return ConnectionError(f"cannot reach NATS at {url}: {why}")


async def finish(nc: Client) -> None:
    """Drain `nc` so the last acks and events reach the server, then close it; a connection
    that is not up (its server stopped first, or gone) is closed at once. Never raises: a
    service that has done its work exits, with one line saying what was left unsent."""
    if nc.is_closed:
        return
    if nc.is_connected:
        try:
            await nc.drain()
            return
        except Exception as exc:  # the server went while draining
            log.warning("the connection closed while draining (%s)", type(exc).__name__)
    else:
        log.warning("NATS is out of reach at exit: what was still unsent is dropped")
    with contextlib.suppress(Exception):
        await nc.close()


async def _attempt(
    nc: Client, url: str, denied: asyncio.Event, creds: Mapping[str, Any], **opts: Any
) -> None:
    """One try at connecting `nc`, which fails with ConfigError as soon as `denied` says the
    server refused the credentials."""
    attempt = asyncio.ensure_future(nc.connect(servers=url.split(","), **opts, **creds))
    refused = asyncio.ensure_future(denied.wait())
    try:
        await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused.cancel()
    if denied.is_set():
        attempt.cancel()
        with contextlib.suppress(BaseException):
            await nc.close()
        who = creds.get("user") or "no user"
        raise ConfigError(
            f"NATS at {url} refused the credentials ({who}): set NATS_USER and "
            "NATS_PASSWORD, or NATS_AUTH_FILE (`baton up` writes them to DATA_DIR/auth)"
        )
    await attempt


async def publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    msg_id: str,
    headers: Mapping[str, str] | None = None,
    attempts: int = 0,
    timeout: float = 2.0,
) -> PubAck:
    """Publish to a stream until it is stored. `msg_id` makes the retries safe: a publish
    that timed out may still land from the client's buffer after a reconnect, and the
    stream's duplicate window drops the second copy. `attempts=0` retries forever.

    `headers` ride along (CAS and TTL headers, W3C trace context from
    `shared.telemetry.inject`); `msg_id` is set last, so no header copied from elsewhere
    can replace the id that makes the retries safe."""
    hdrs = {**(headers or {}), "Nats-Msg-Id": msg_id}
    try:  # the common case, without the retry loop's set-up (hot in the dispatcher)
        ack = await js.publish(subject, payload, headers=hdrs, timeout=timeout)
    except RETRY_PUBLISH as exc:
        _unconfirmed(subject).failed(exc)
        if attempts == 1:
            raise
    else:
        if _failing:
            _unconfirmed(subject).ok()
        return ack
    unconfirmed = _unconfirmed(subject)

    async def once() -> PubAck:
        try:
            ack = await js.publish(subject, payload, headers=hdrs, timeout=timeout)
        except RETRY_PUBLISH as exc:
            unconfirmed.failed(exc)
            raise
        unconfirmed.ok()
        return ack

    backoff = Backoff(first=0.1, most=2.0)
    await asyncio.sleep(backoff.next())
    return await retrying(
        once,
        retry_on=RETRY_PUBLISH,
        what=f"publish to {subject} not confirmed",
        backoff=backoff,
        attempts=max(0, attempts - 1),
        log=log,
        level=logging.DEBUG,
    )


_failing: dict[str, Condition] = {}
"""One condition per destination (`where`), kept while any of its publishes fail: every
publish that is retried during a cut shares it, so the cut is logged once, not per try."""


def _unconfirmed(subject: str) -> Condition:
    """The condition of publishes to where `subject` goes, logged on `log` (once as they
    start failing, once as one is confirmed again); it stays registered only while on."""
    key = where(subject)
    found = _failing.get(key)
    if found is None:
        found = _failing[key] = _Unconfirmed(key)
    return found


class _Unconfirmed(Condition):
    """A `Condition` that keeps itself in `_failing` exactly while it is on."""

    def __init__(self, key: str) -> None:
        super().__init__(log, f"publishes to {key}", "each is retried until it is stored")
        self.key = key

    def ok(self) -> bool:
        _failing.pop(self.key, None)
        return super().ok()


def where(subject: str) -> str:
    """What `subject` names as a destination, without the per-message tokens: the bucket of a
    KV write (`$JS.hub.API.$KV.baton_leases`), else the kind of message, at a site or not
    (`baton.events`, `baton.site.lab1.events`)."""
    tokens = subject.split(".")
    if subject.startswith("$JS.") and "$KV" in tokens:
        return ".".join(tokens[: tokens.index("$KV") + 2])
    return ".".join(tokens[: 4 if tokens[1:2] == ["site"] else 2])


RETRY_PUBLISH = (TimeoutError, NoStreamResponseError, nats.errors.TimeoutError)
UNAVAILABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
"""What a JetStream request raises while JetStream cannot answer: a stream electing its
leader, a clustered hub without a majority of its nodes up or electing its meta leader (as
in its first seconds), a server gone (docs/nats.md)."""
