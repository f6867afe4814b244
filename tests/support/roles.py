"""A hub nats-server as `baton up` runs it — its authorization, a user per role — for tests
that run a service's code in the test's process: the code under test connects as its own
role, the test's set-up as the operator, so a permission the role lacks fails the test
(the server's refusal reaches the client only as a timeout; the audit reads the log)."""

from __future__ import annotations

import logging
from pathlib import Path

from nats.aio.client import Client

from baton.stack.cluster import HubCluster
from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions, vault
from baton.stack.servers import hub
from shared.bus.connect import connect
from shared.bus.streams import declared, ensure
from shared.credentials import Vault, options_for
from tests.support.audit import Audit

log = logging.getLogger("tests.roles")


class AuthorizedHub:
    def __init__(self, root: Path, *, machines: bool = False) -> None:
        """`machines`: as `baton up --machines`, users not of the stack's own roles are
        asked of the registrar (which the test runs itself, `services/registrar`)."""
        self.root = root
        self.opts = StackOptions(data_dir=root, port=0, machines=machines)
        self.cluster: HubCluster = hub(self.opts, http_port=0)
        keys = vault(self.opts)
        assert keys is not None, "authorization is on by default"
        self.vault: Vault = keys
        self.clients: list[Client] = []
        self.audit = Audit(root)

    @property
    def server(self) -> NatsServer:
        return self.cluster.nodes[0]

    @property
    def url(self) -> str:
        return self.cluster.url

    async def start(self) -> None:
        """The server, with Baton's streams and buckets declared (by the operator), as a
        service declares them: until JetStream answers (a server just started on a loaded
        machine may leave the first request unanswered)."""
        await self.cluster.start()
        js = (await self.connect("operator")).jetstream()
        await declared(lambda: ensure(js), log)

    async def connect(self, role: str, name: str = "") -> Client:
        """A client logged in as `role` (named `name`, for the server's connection list)."""
        nc = await connect(
            self.url, name or f"as-{role}", first_attempt_timeout=10,
            options=options_for(self.vault.get(role)),
        )  # fmt: skip
        self.clients.append(nc)
        return nc

    async def stop(self) -> None:
        """Close every client, stop the server, then read its log: nothing refused."""
        for nc in self.clients:
            if not nc.is_closed:
                await nc.close()
        await self.cluster.stop()
        self.audit.check()
