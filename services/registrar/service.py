"""The registrar: who a machine is, at every connection it makes.

The hub's servers ask it about every user they do not know themselves (NATS's auth
callout, `shared.machines.callout`): a machine, by the id and secret it got when it joined,
is admitted with its own permissions (`shared.auth.machine_permissions`) unless it was
revoked; a new machine, by its join token, is admitted only to ask to join. Anyone else is
refused. It answers joins (`baton.join.<token>`: the token is used once, by compare-and-
swap, and the machine gets an identity and the store's location) and revocations
(`baton.machines.revoke`: the record first, so the machine is refused from then on, then
its open connections closed, through the system account, on every server of the hub).

It holds no state of its own: every answer reads the `baton_machines` bucket, so a
registrar restarted — or a second one — answers the same. While none runs, configured users
(every service, operators, sites) connect as before; machines and the stack's people, whom
it admits too (docs/machines.md), wait. Logins are answered side by side (`ANSWERING`): a
hub restarted has every machine log in again at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.registrar.logins import Logins
from shared.auth import (
    CALLOUT_SUBJECT,
    joiner_permissions,
    machine_permissions,
    submitter_permissions,
)
from shared.bus import names
from shared.bus.connect import connect
from shared.bus.streams import declared, ensure
from shared.config import Settings
from shared.contracts import decode, encode
from shared.contracts.checkpoints import StoreInfo
from shared.contracts.machines import JoinAnswer, JoinRequest, Machine, Revoke, Revoked
from shared.credentials import Credentials, options_for, read_env_file
from shared.errors import ContractError
from shared.machines import registry
from shared.machines.callout import Request, Signer
from shared.machines.connections import close_all, close_users
from shared.machines.registry import Registry
from shared.state.hub import read_store

log = logging.getLogger("baton.registrar")

MAX_TRAINERS = 64
STORE_WAIT_S = 20.0
STORE_POLL_S = 0.25
SHARED_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
    "AWS_DEFAULT_REGION", "BATON_S3_ENDPOINT", "AWS_ENDPOINT_URL", "BATON_LEASE_TTL",
)  # fmt: skip
"""What the hub's services run with that a machine's trainers must share: the store's
settings and credentials, the lease TTL (`JoinAnswer.env`)."""


class Registrar:
    def __init__(
        self, nc: Client, settings: Settings, seed: bytes, system: Credentials,
        people_dir: Path | None = None,
    ) -> None:  # fmt: skip
        """`seed`: the account key the callout's answers are signed with; `system`: the
        system account's user, which closes connections; `people_dir`: the stack's people
        (`baton.stack.people`: `people.json` and a credentials file each), admitted here
        too — the servers ask about every user not in their `auth_users`, a list that
        cannot change while they run (docs/machines.md)."""
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.signer = Signer(seed)
        self.logins = Logins(self.signer, self.admit)
        self.registry = Registry(self.js)
        self.system_user = system
        self.system: Client | None = None
        self.people_dir = people_dir

    async def start(self) -> None:
        await declared(lambda: ensure(self.js, self.settings.replicas), log)
        self.system = await connect(self.settings.nats_url, "baton-registrar-system",
                                    options=options_for(self.system_user))  # fmt: skip
        await self.nc.subscribe(CALLOUT_SUBJECT, cb=self.logins.on_request)
        await self.nc.subscribe(names.join_subject("*"), cb=self._on_join)
        await self.nc.subscribe(names.SITE_JOIN_ALL, cb=self._on_join)
        await self.nc.subscribe(names.REVOKE_SUBJECT, cb=self._on_revoke)
        await self.nc.subscribe(names.REGISTRAR_HELLO, cb=self._on_hello)
        await self.nc.flush()
        log.info("registrar answering for machines (issuer %s)", self.signer.issuer)
        # A revocation whose closing a registrar did not finish (it died in between).
        try:
            revoked = {m.id for m in await self.registry.machines() if m.revoked}
            if revoked and (closed := await close_users(self.system, revoked)):
                log.info("closed %d connection(s) of revoked machines", closed)
        except Exception:  # the hub busy: they stay refused at their next login anyway
            log.exception("could not close what revocations left open")

    async def serve(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def on_reconnect(self) -> None:
        pass

    async def close(self) -> None:
        self.logins.close()
        if self.system is not None:
            await self.system.close()

    async def _on_hello(self, msg: Msg) -> None:
        await msg.respond(b"machines admitted")

    # -- who is connecting ---------------------------------------------------------

    async def admit(self, req: Request) -> bytes:
        user = req.user
        if user.startswith(registry.JOINER_PREFIX):
            token_id = user.removeprefix(registry.JOINER_PREFIX)
            found = await self.registry.token(token_id)
            if found is None or not registry.matches(req.password, found[0].digest):
                return self._deny(req, "not a join token of this hub")
            return self.signer.allow(req, user, joiner_permissions(user, token_id), 60)
        if registry.is_machine(user):
            m = await self.registry.machine(user)
            if m is None or not registry.matches(req.password, m[0].digest):
                return self._deny(req, "not a machine of this hub, or a wrong secret")
            if m[0].revoked:
                return self._deny(req, f"machine {user} was revoked")
            if m[0].site:
                return self._deny(req, f"machine {user} joined site {m[0].site}: it logs in there")
            return self.signer.allow(req, user, machine_permissions(user, m[0].workers()))
        if (person := self._person(user)) is not None:
            if not hmac.compare_digest(person.password.encode(), req.password.encode()):
                return self._deny(req, "a wrong password")
            return self.signer.allow(req, user, submitter_permissions(user))
        return self._deny(req, "unknown user")

    def _person(self, user: str) -> Credentials | None:
        """`user`'s credentials if it is one of the stack's people now."""
        if self.people_dir is None:
            return None
        try:
            people = json.loads((self.people_dir / "people.json").read_text())
            if not isinstance(people, list) or user not in people:
                return None
            return read_env_file(self.people_dir / f"{user}.env")
        except (OSError, ValueError):
            return None  # removed meanwhile, or the file half written: not a person now

    def _deny(self, req: Request, reason: str) -> bytes:
        return self.logins.deny(req, reason)

    # -- joins ---------------------------------------------------------------------

    async def _on_join(self, msg: Msg) -> None:
        """A join asked here, or passed on by a site's registrar (`names.site_join_subject`:
        the machine joins that site)."""
        parts = msg.subject.split(".")
        token_id, site = parts[-1], (parts[2] if parts[1] == "site" else "")
        try:
            answer = await self.join(token_id, decode(msg.data, JoinRequest), site)
        except ContractError as exc:
            answer = JoinAnswer(error=f"a bad join request: {exc}")
        except Exception:  # the bucket unreachable: nothing was used up; the machine may ask again
            log.exception("could not answer a join with token %s", token_id)
            answer = JoinAnswer(error="the registrar could not read its records; try again")
        if answer.error:
            log.warning("refused a join with token %s: %s", token_id, answer.error)
        await msg.respond(encode(answer))

    async def join(self, token_id: str, req: JoinRequest, site: str = "") -> JoinAnswer:
        """Use the token for a new machine of its pool, at `site` ("": the hub), which must
        be the token's."""
        if not 1 <= req.trainers <= MAX_TRAINERS:
            return JoinAnswer(error=f"trainers must be 1 to {MAX_TRAINERS}, not {req.trainers}")
        found = await self.registry.token(token_id)
        if found is None:
            return JoinAnswer(error="not a join token of this hub")
        token, revision = found
        if why := registry.refusal(token, time.time()):
            return JoinAnswer(error=why)
        if token.site != site:
            where = f"site {token.site}: join at its leaf node" if token.site else "the hub"
            return JoinAnswer(error=f"this token is for {where}, not {site or 'the hub'}")
        store = await self._store()
        if store is None:
            return JoinAnswer(error="the hub does not say where its store is yet; try again")
        secret = registry.new_secret()
        machine = Machine(
            id=f"{registry.MACHINE_PREFIX}{registry.new_id()}", host=req.host[:200],
            pool=token.pool, site=token.site, digest=registry.digest(secret),
            trainers=req.trainers, gpus=req.gpus[: req.trainers], token=token.id,
            joined_at=time.time(),
        )  # fmt: skip
        if not await self.registry.use_token(token, revision, machine):
            return JoinAnswer(error="this token was used already, just now; ask for a new one")
        log.info("%s joined pool %s from %s with %d trainer(s)",
                 machine.id, machine.pool, machine.host, machine.trainers)  # fmt: skip
        env = {k: os.environ[k] for k in SHARED_ENV if os.environ.get(k)}
        return JoinAnswer(
            machine=machine.id, secret=secret, pool=machine.pool, site=machine.site,
            store=store, env=env,
        )  # fmt: skip

    async def _store(self) -> StoreInfo | None:
        """Where the store is. A hub just started may not have said so yet — its
        checkpointer does once it has declared its streams — so a join waits for it, up to
        `STORE_WAIT_S`, rather than be refused."""
        for _ in range(int(STORE_WAIT_S / STORE_POLL_S)):
            if (store := await read_store(self.js)) is not None:
                return store
            await asyncio.sleep(STORE_POLL_S)
        return await read_store(self.js)

    # -- revocations ---------------------------------------------------------------

    async def _on_revoke(self, msg: Msg) -> None:
        try:
            answer = await self.revoke(decode(msg.data, Revoke))
        except ContractError as exc:
            answer = Revoked(error=f"a bad request: {exc}")
        except Exception:  # what was done stands: the record first, then the closing
            log.exception("could not finish a revocation")
            answer = Revoked(error="the revocation did not finish; ask again (it is idempotent)")
        await msg.respond(encode(answer))

    async def revoke(self, ask: Revoke) -> Revoked:
        """The record first — every later login is refused — then the open connections."""
        done = await self.registry.revoke(ask.machine, ask.by)
        if done is None:
            return Revoked(error=f"no machine {ask.machine}")
        log.info("%s revoked by %s", done.id, ask.by or "an operator")
        assert self.system is not None
        closed = await close_all(self.system, done.id)
        return Revoked(machine=done.id, closed=closed, site=done.site)
