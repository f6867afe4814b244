"""Answering the servers' auth callout (`shared.machines.callout`): every login of a user
the servers do not bypass arrives as a signed request, and gets a signed answer — a user
JWT with the user's permissions, or a refusal with its reason.

nats-py runs one subscription's callbacks one after another, so each login is answered in
a task of its own, at most `ANSWERING` at once: a hub (or site) restarted has every machine
log in again at the same moment, and one slow read of the records must not hold the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from shared.machines.callout import Request, Signer, decode_request

log = logging.getLogger("baton.registrar")

ANSWERING = 64
"""Logins answered at once (each a read of the records)."""

Admit = Callable[[Request], Awaitable[bytes]]


class Logins:
    def __init__(self, signer: Signer, admit: Admit) -> None:
        """`admit` answers one login: `allow` or `deny` of `signer`."""
        self.signer = signer
        self._admit = admit
        self._answering: set[asyncio.Task[None]] = set()
        self._room = asyncio.Semaphore(ANSWERING)

    async def on_request(self, msg: Msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    def deny(self, req: Request, reason: str) -> bytes:
        log.warning("refused %r from %s: %s", req.user, req.host, reason)
        return self.signer.deny(req, reason)

    def close(self) -> None:
        for task in self._answering:
            task.cancel()

    async def _answer(self, msg: Msg) -> None:
        async with self._room:
            try:
                req = decode_request(msg.data)
            except ValueError as exc:
                log.warning("ignored a callout request: %s", exc)
                return
            try:
                answer = await self._admit(req)
            except Exception:  # the records unreachable: refused now, asked again at the retry
                log.exception("could not decide on %r from %s", req.user, req.host)
                answer = self.signer.deny(req, "the registrar could not read its records")
            await msg.respond(answer)
