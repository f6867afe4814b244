"""A site's registrar: its leaf node's auth callout, answered from the site's copy of the
hub's records, so machines that joined at the site log in there through a WAN cut too.

A site that admits machines (`baton up --site S --machines`) runs its own registrar beside
its leaf node, which asks it about every user but the site's own roles:

* **Logins** are answered from the site's copy of the hub's machine and token records
  (`shared.machines.copy`), which the site's JetStream sources from the hub while the link
  is up. A machine of this site, by its secret, unless revoked, gets a site trainer's rights
  for its own worker ids (`shared.auth.site_machine_permissions`); a new machine, by a join
  token for this site, may only ask to join. A machine of the hub or of another site is
  refused, saying where it belongs.
* **Joins** need the hub: a token is used once, by a compare-and-swap on the hub's record. A
  join asked at the site is passed on to the hub's registrar on the site's own subject
  (`names.site_join_subject`) and its answer passed back; cut off, the machine is told to
  try again once the link is up.
* **Revocations** are the hub's (`baton machines revoke`): when the record reaches the
  site's copy, this registrar closes the machine's connections at the leaf node, through
  the site's system account. Its runs are the site's to hand over: their leases lapse, and
  their tasks are delivered again, as for any site trainer gone silent. A revocation made
  during a cut reaches the site when the link heals; until then the site admits the machine
  as it last knew it.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy

from services.registrar.logins import Logins
from shared.auth import CALLOUT_SUBJECT, joiner_permissions, site_machine_permissions
from shared.bus import names
from shared.bus.connect import connect
from shared.bus.streams import declared, ensure_site_machines
from shared.config import Settings
from shared.contracts import encode
from shared.contracts.machines import JoinAnswer
from shared.credentials import Credentials, options_for
from shared.machines import registry
from shared.machines.callout import Request, Signer
from shared.machines.connections import close_all
from shared.machines.copy import SiteCopy, record_subject
from shared.machines.registry import revoked_in

log = logging.getLogger("baton.registrar")

PASS_ON_S = 25.0
"""How long a join passed on to the hub may take: the hub's registrar may wait for its
store to be said (`services.registrar.service.STORE_WAIT_S`), and the machine waits for
the answer a little longer (`baton.stack.machine.JOIN_TIMEOUT_S`)."""


class SiteRegistrar:
    def __init__(self, nc: Client, settings: Settings, seed: bytes, system: Credentials) -> None:
        """`seed`: the site's callout key; `system`: the site's system account's user."""
        assert settings.site, "a site's registrar runs at a site"
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.site = settings.site
        self.copy = SiteCopy(self.js, nc.jetstream(domain=names.HUB_DOMAIN))
        self.logins = Logins(Signer(seed), self.admit)
        self.system_user = system
        self.system: Client | None = None
        self._watch: Subscription | None = None

    async def start(self) -> None:
        await declared(lambda: ensure_site_machines(self.js, self.site), log)
        self.system = await connect(self.settings.nats_url, "baton-registrar-system",
                                    options=options_for(self.system_user))  # fmt: skip
        await self.nc.subscribe(CALLOUT_SUBJECT, cb=self.logins.on_request)
        await self.nc.subscribe(names.join_subject("*"), cb=self._on_join)
        await self.nc.subscribe(names.REGISTRAR_HELLO, cb=self._on_hello)
        # Every machine record as the site has it, then each change: a revoked machine of
        # this site is closed here — also one whose closing a registrar before this one
        # did not finish.
        self._watch = await self.js.subscribe(
            record_subject("machine", "*"), stream=names.HUB_MACHINES_STREAM,
            cb=self._on_record, ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        )  # fmt: skip
        await self.nc.flush()
        log.info("registrar answering for site %s's machines", self.site)

    async def serve(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def on_reconnect(self) -> None:
        pass

    async def close(self) -> None:
        self.logins.close()
        if self._watch is not None:
            await self._watch.unsubscribe()
        if self.system is not None:
            await self.system.close()

    async def _on_hello(self, msg: Msg) -> None:
        await msg.respond(f"machines admitted at site {self.site}".encode())

    # -- who is connecting ---------------------------------------------------------

    async def admit(self, req: Request) -> bytes:
        user = req.user
        if user.startswith(registry.JOINER_PREFIX):
            token_id = user.removeprefix(registry.JOINER_PREFIX)
            token = await self.copy.token(token_id)
            if token is None or not registry.matches(req.password, token.digest):
                return self.logins.deny(req, "not a join token of this hub")
            # A token of the hub's or another site's may ask too: the hub's registrar then
            # says where it belongs, which a refused login could not.
            return self.logins.signer.allow(req, user, joiner_permissions(user, token_id), 60)
        if registry.is_machine(user):
            m = await self.copy.machine(user)
            if m is None or not registry.matches(req.password, m.digest):
                return self.logins.deny(req, "not a machine of this hub, or a wrong secret")
            if m.revoked:
                return self.logins.deny(req, f"machine {user} was revoked")
            if m.site != self.site:
                return self.logins.deny(req, f"machine {user} joined {_where(m.site)}")
            perms = site_machine_permissions(user, m.workers(), self.site)
            return self.logins.signer.allow(req, user, perms)
        return self.logins.deny(req, "unknown user")

    # -- joins ---------------------------------------------------------------------

    async def _on_join(self, msg: Msg) -> None:
        token_id = msg.subject.rsplit(".", 1)[1]
        subject = names.site_join_subject(self.site, token_id)
        try:
            reply = await self.nc.request(subject, msg.data, timeout=PASS_ON_S)
            data = reply.data
        except (NatsError, TimeoutError) as exc:
            log.warning("could not pass a join with token %s on to the hub: %r", token_id, exc)
            why = f"site {self.site} cannot reach the hub's registrar now; try again once linked"
            data = encode(JoinAnswer(error=why))
        await msg.respond(data)

    # -- revocations ---------------------------------------------------------------

    async def _on_record(self, msg: Msg) -> None:
        machine = revoked_in(msg.data)
        if machine is None or machine.site != self.site or self.system is None:
            return
        try:
            closed = await close_all(self.system, machine.id)
        except Exception:  # its reconnects are refused anyway
            log.exception("%s: could not close its connections", machine.id)
            return
        if closed:
            log.info("%s revoked: closed %d connection(s) at site %s", machine.id, closed,
                     self.site)  # fmt: skip


def _where(site: str) -> str:
    return f"site {site}" if site else "the hub"
