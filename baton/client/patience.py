"""A client connection that rides a hub node's restart or a stream leader's election.

On a clustered hub, the node that led a stream answers nothing once it dies, and the stream
answers nothing either until its followers have elected a new leader: 2.3–5.5 s measured
(docs/nats.md). A command that asked once in that window, with nats-py's 5 s timeout, failed
with "JetStream did not answer" while the run it read trained on untouched. So every request
a client command makes that is safe to repeat is tried again, in short tries with back-off,
for up to `PATIENCE_S` — well above a measured election — and the command says once on
stderr that it is waiting. What still fails after that fails as before, in one line; a
stream or bucket that does not exist is an answer, and an error at once.

Safe to repeat: JetStream's reads (infos, names, lists, message gets), and a publish that
carries a message id, which the stream's duplicate window stores once however often it
comes; and the creation of a consumer the server names, which places a new one each time.
Only the connected server's own JetStream is waited for: a read of another domain (the
hub's, from a site's leaf) crosses a link that may be cut, which a command says at once.
Nothing else is tried twice as it was: a delete or a conditional write tried again
after a lost answer would fail on its own success, and a consumer made again under the same
name waits on the node it was first placed on, which may be the dead one (seen: 30 s of
timeouts). A reader makes its consumer with `patiently`, under a new name each try.

The override is of `Client.request`, the one public call every JetStream API request, direct
get and stream publish of nats-py goes through; it applies to the connections of the CLI
and the dashboard (`client.open_nats`), never to the services, which wait out outages their
own way.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from shared.backoff import Backoff

T = TypeVar("T")

PATIENCE_S = 30.0
"""How long a request is tried again: several elections' worth (each 2.3–5.5 s measured)."""
FIRST_TRY_S = 1.0
"""The first try's timeout; each next try's doubles, up to what the caller asked for."""

_REPEATABLE = re.compile(
    r"^\$JS\.API\.(?:INFO|STREAM\.(?:INFO|NAMES|LIST|MSG\.GET)"
    r"|CONSUMER\.(?:INFO|NAMES|LIST)|DIRECT\.GET)(?:\.|$)"
    r"|^\$JS\.API\.CONSUMER\.CREATE\.[^.]+$"
)
_UNAVAILABLE = re.compile(rb'"error"\s*:\s*\{[^}]*"code"\s*:\s*503')
"""JetStream's own "temporarily unavailable" answer, sent while it has no leader to ask."""


def repeatable(subject: str, headers: dict[str, Any] | None) -> bool:
    """Whether a request to `subject` may be made again after its answer was lost."""
    return bool(_REPEATABLE.match(subject)) or bool(headers and headers.get("Nats-Msg-Id"))


class PatientClient(Client):
    """A `Client` whose repeatable requests ride an election (see the module's text).
    `waiting(seconds)` is called once, the first time a request has to be tried again."""

    def __init__(
        self, waiting: Callable[[float], None] | None = None, patience_s: float = PATIENCE_S
    ) -> None:
        super().__init__()
        self.patience_s = patience_s
        self._waiting = waiting
        self._said = False

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        if not repeatable(subject, headers) or self.patience_s <= 0:
            return await super().request(subject, payload, timeout, old_style, headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.patience_s
        delays = Backoff(first=0.2, most=2.0)
        try_s = min(FIRST_TRY_S, timeout)
        while True:
            try:
                msg = await super().request(subject, payload, try_s, old_style, headers)
            except (NatsTimeoutError, NoRespondersError) as exc:
                if loop.time() + delays.first >= deadline:
                    raise
                if isinstance(exc, NoRespondersError) and not await self._stored(subject):
                    raise  # a publish no stream takes: no election will change that
            else:
                if not _UNAVAILABLE.search(msg.data[:512]) or loop.time() >= deadline:
                    return msg
            self.say_waiting()
            await asyncio.sleep(min(delays.next(), max(deadline - loop.time(), 0.0)))
            try_s = min(try_s * 2, max(timeout, FIRST_TRY_S))

    async def _stored(self, subject: str) -> bool:
        """Whether a stream takes `subject` (a JetStream subject is, by definition), or
        that cannot be known now; False only when JetStream answered that none does."""
        if subject.startswith("$JS."):
            return True
        query = json.dumps({"subject": subject}).encode()
        try:
            answer = await super().request("$JS.API.STREAM.NAMES", query, FIRST_TRY_S)
            names = json.loads(answer.data)
        except Exception:
            return True
        return "error" in names or bool(names.get("streams"))

    def say_waiting(self) -> None:
        if not self._said:
            self._said = True
            if self._waiting is not None:
                self._waiting(self.patience_s)


async def patiently(nc: Client, attempt: Callable[[], Awaitable[T]]) -> T:
    """`attempt()`, made again while JetStream does not answer, for as long as `nc` is
    patient (a `PatientClient`; any other client gets one try). For an operation that must
    be made afresh each time rather than repeated as it was, such as a consumer's creation."""
    patience = nc.patience_s if isinstance(nc, PatientClient) else 0.0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    delays = Backoff(first=0.2, most=2.0)
    while True:
        try:
            return await attempt()
        except (NatsTimeoutError, NoRespondersError, ServiceUnavailableError, TimeoutError):
            if loop.time() + delays.first >= deadline:
                raise
        assert isinstance(nc, PatientClient)
        nc.say_waiting()
        await asyncio.sleep(min(delays.next(), max(deadline - loop.time(), 0.0)))
