"""A site's copy of the hub's machine and token records (`names.HUB_MACHINES_STREAM`).

The hub keeps the records (`shared.machines.registry`); a site that admits machines sources
them into a stream of its own domain while its link is up (`shared.bus.streams.hub_machines`),
newest per key, so its registrar answers its leaf node's logins from what it last saw —
through a cut too. Read by subject, as the bucket is read at the hub; a deleted record reads
as none. Nothing writes here but the sourcing: every change is the hub's.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.contracts import decode
from shared.contracts.machines import JoinToken, Machine
from shared.errors import ContractError

R = TypeVar("R", Machine, JoinToken)
HUB_ASK_S = 2.0
"""How long a login waits for the hub's record when the copy has none."""


def record_subject(kind: str, key: str) -> str:
    """The subject of a record (`machine`, `token`) in the bucket and in a site's copy."""
    return f"$KV.{names.MACHINES_BUCKET}.{kind}.{key}"


class SiteCopy:
    def __init__(self, js: JetStreamContext, hub: JetStreamContext | None = None) -> None:
        """`js`: the site's own JetStream; `hub`: the hub's, as the site reaches it, asked
        for a record the copy does not hold yet (one made a moment ago: a token just
        created, a machine that just joined). Cut off, the copy is all there is."""
        self.js = js
        self.hub = hub

    async def token(self, token_id: str) -> JoinToken | None:
        return await self._get(record_subject("token", token_id), JoinToken)

    async def machine(self, machine_id: str) -> Machine | None:
        return await self._get(record_subject("machine", machine_id), Machine)

    async def _get(self, subject: str, kind: type[R]) -> R | None:
        try:
            msg = await self.js.get_last_msg(names.HUB_MACHINES_STREAM, subject, direct=True)
        except NotFoundError:
            if self.hub is None:
                return None
            try:
                stream = f"KV_{names.MACHINES_BUCKET}"
                msg = await asyncio.wait_for(
                    self.hub.get_last_msg(stream, subject, direct=True), HUB_ASK_S
                )
            except (NatsError, TimeoutError):  # none there, or the link is down
                return None
        if not msg.data or (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            return None
        try:
            return decode(msg.data, kind)
        except ContractError:
            return None
