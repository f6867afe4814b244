"""A site for chaos tests: a leaf nats-server in its own JetStream domain that reaches the
hub's WebSocket through a `Proxy` the test can sever or blackhole, plus the site's
checkpointer and trainers as real processes under the hub stack's supervisor.

The hub `Stack` owns the cleanup: its `stop()` stops every process (sites' included), then
the sites' leaf nodes and proxies, then the hub's server — also when the test failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from baton.client import reader
from baton.stack.natsserver import NatsServer
from baton.stack.options import user_of, vault
from baton.stack.servers import nats_server
from baton.stack.services import service_specs
from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.connect import connect
from shared.credentials import options_for
from shared.state.workers import live_workers
from tests.support.proxy import Proxy
from tests.support.stack import Stack, eventually

CLI_TIMEOUT_S = 60
"""A bound on a hang of a `baton` command, not on its speed."""
SOURCED = "Nats-Stream-Source"
Sent = tuple[str, bytes]
"""A stored message's subject and payload."""
"""The header JetStream puts on a message one stream sourced from another."""


class Site:
    def __init__(
        self, hub: Stack, name: str, *, direct: bool = False, env: dict[str, str] | None = None
    ) -> None:
        """`direct`: the leaf dials every node of the hub itself, with no proxy between (a
        clustered hub's test loses nodes, not the link); `env`: the site's processes' own
        (an S3 endpoint of its own, behind a proxy the test cuts with the link)."""
        self.hub = hub
        self.name = name
        self.root = hub.root / "sites" / name
        self.direct = direct
        self.proxy = Proxy("127.0.0.1", hub.ws_port)
        self.opts = msgspec.structs.replace(
            hub.opts, data_dir=self.root, site=name, store=hub.store_url, trainers=0, port=0,
            hub_auth=str(hub.root / "auth" / f"site-{name}.env"),
            extra_env={**hub.opts.extra_env, **(env or {})},
        )  # fmt: skip
        self._nats: NatsServer | None = None
        self.trainers: list[str] = []

    @property
    def nats(self) -> NatsServer:
        assert self._nats is not None, "the site has not been started"
        return self._nats

    async def start(self, trainers: int = 1) -> None:
        """Leaf node, checkpointer, and trainers named `<site>-trainer-<n>`."""
        self.hub.after_services.append(self._undo)
        if self.direct:
            hub_url = ",".join(self.hub.hub.ws_urls)
        else:
            await self.proxy.start()
            hub_url = f"ws://127.0.0.1:{self.proxy.port}"
        self.opts = msgspec.structs.replace(self.opts, hub_url=hub_url)
        self._nats = nats_server(self.opts)
        await self.nats.start()
        for spec in service_specs(self.opts, self.nats.url):
            await self.hub.add(msgspec.structs.replace(spec, name=f"{self.name}-{spec.name}"))
        for i in range(1, trainers + 1):
            await self.add_trainer(f"{self.name}-trainer-{i}")
        await self.linked()

    async def add_trainer(self, name: str, *, restart: bool = False) -> int:
        """A trainer at this site (keep `trainer-` in `name`: the stop order looks for it);
        `restart`: restarted when it dies, as `baton up --site` runs it."""
        one = msgspec.structs.replace(self.opts, trainers=1)
        base = next(s for s in service_specs(one, self.nats.url) if "trainer-" in s.name)
        env = {
            **base.env,
            "BATON_WORKER_ID": name,
            "BATON_WORK_DIR": str(self.root / "work" / name),
        }
        self.trainers.append(name)
        spec = msgspec.structs.replace(base, name=name, env=env)
        return await self.hub.add(spec, restart=restart)

    async def linked(self, timeout: float = 30) -> None:
        """Until the hub sources this site's outbox and every site trainer is registered
        at the hub (its heartbeat came through the outbox)."""
        nc = await self.hub.client()

        async def ready() -> bool:
            sources = await sites.source_states(nc, names.EVENTS_STREAM)
            if sites.api_of(self.name) not in sources:
                return False
            registered = {w.worker for w in await live_workers(nc.jetstream())}
            return set(self.trainers) <= registered

        await eventually(ready, timeout, f"site {self.name} to link to the hub")

    async def client(self, role: str = "operator") -> Client:
        """A client of the site's leaf node, as a user of the site (its operator, or
        `submitter`, `trainer`…) would have."""
        v = vault(self.opts)
        options = options_for(v.get(user_of(self.opts, role))) if v else {}
        nc = await connect(
            self.nats.url, f"test-{self.name}", first_attempt_timeout=10, options=options
        )
        self.hub.clients.append(nc)
        return nc

    async def outbox(self, subject_filter: str) -> list[tuple[str, bytes]]:
        """(subject, payload) of the site's outbox messages matching `subject_filter`."""
        return await stored(await self.client(), names.OUTBOX_STREAM, subject_filter)

    async def _events(self, nc: Client, run_id: str) -> tuple[list[Sent], list[Sent]]:
        """The run's events the site sent (its outbox), as the hub's stream names them, and
        those of the hub's stream that came from the site, each in stored order."""
        sent = await self.outbox(names.at_site(names.events_of_run(run_id), self.name))
        sub = await reader.read(nc, names.EVENTS_STREAM, names.events_of_run(run_id))
        try:
            got = await reader.drain(sub)
        finally:
            await sub.unsubscribe()
        # The hub's own services publish some (`accepted`; a `handed_over` when a lease
        # lapsed): what came from the site is what the hub's stream sourced.
        from_site = [(m.subject, m.data) for m in got if SOURCED in (m.headers or {})]
        want = [(names.event_subject(run_id, s.rsplit(".", 1)[1]), d) for s, d in sent]
        return want, from_site

    async def delivered(self, nc: Client, run_id: str) -> bool:
        """The hub holds as many of the run's site events as the site sent (after a heal,
        its outbox drains into the hub's stream in the background)."""
        want, from_site = await self._events(nc, run_id)
        return len(from_site) >= len(want)

    async def assert_events_once_in_order(self, nc: Client, run_id: str) -> None:
        """The hub's events of `run_id` that came from this site are, message for message,
        the site's outbox in the order the site stored it: each arrived once, in order."""
        want, from_site = await self._events(nc, run_id)
        assert len(want) > 3, f"too few events to tell anything: {len(want)}"
        assert from_site == want, (
            f"hub holds {len(from_site)} site events, the site sent {len(want)}: "
            "each must arrive once, in order"
        )

    async def cli(self, *args: str) -> tuple[int, str, str]:
        """`python -m baton ARGS` pointed at the site's leaf as the site's operator: (exit
        code, stdout, stderr)."""
        auth = self.root / "auth" / f"{self.name}-operator.env"
        assert auth.is_file(), f"no operator credentials at {auth}"
        env = {**os.environ, "NATS_URL": self.nats.url, "NATS_AUTH_FILE": str(auth)}
        for var in ("NATS_USER", "NATS_PASSWORD", "NATS_CREDS", "BATON_SITE"):
            env.pop(var, None)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "baton", *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            what = f"baton {' '.join(args)} did not end within {CLI_TIMEOUT_S}s"
            raise AssertionError(what) from None
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def _undo(self) -> None:
        await self.proxy.stop()
        if self._nats is not None:
            await self._nats.stop()


async def stored(nc: Client, stream: str, subject_filter: str) -> list[tuple[str, bytes]]:
    """(subject, payload) of every message of `stream` matching `subject_filter`, in order."""
    try:
        sub = await reader.read(nc, stream, subject_filter)
    except NotFoundError:
        return []
    try:
        return [(m.subject, m.data) for m in await reader.drain(sub)]
    finally:
        await sub.unsubscribe()


async def hub_leaves(hub: Stack) -> int:
    """Leaf nodes linked to the hub's server now, from its monitoring endpoint."""

    def get() -> int:
        url = f"http://127.0.0.1:{hub.nats.http_port}/leafz"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return len(json.load(resp).get("leafs") or [])

    return await asyncio.to_thread(get)
