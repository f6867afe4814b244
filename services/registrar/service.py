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
from shared.machines.callout import Request, Signer, decode_request
from shared.machines.connections import close_all, close_users
from shared.machines.registry import Registry
from shared.state.hub import read_store

log = logging.getLogger("baton.registrar")

MAX_TRAINERS = 64
ANSWERING = 64
STORE_WAIT_S = 20.0
STORE_POLL_S = 0.25
"""Logins answered at once (each a read of the bucket)."""
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
        self.registry = Registry(self.js)
        self.system_user = system
        self.system: Client | None = None
        self.people_dir = people_dir
        self._answering: set[asyncio.Task[None]] = set()
        self._room = asyncio.Semaphore(ANSWERING)

    async def start(self) -> None:
        await declared(lambda: ensure(self.js, self.settings.replicas), log)
        self.system = await connect(self.settings.nats_url, "baton-registrar-system",
                                    options=options_for(self.system_user))  # fmt: skip
        await self.nc.subscribe(CALLOUT_SUBJECT, cb=self._on_auth)
        await self.nc.subscribe(names.join_subject("*"), cb=self._on_join)
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
        for task in self._answering:
            task.cancel()
        if self.system is not None:
            await self.system.close()

    async def _on_hello(self, msg: Msg) -> None:
        await msg.respond(b"machines admitted")

    # -- who is connecting ---------------------------------------------------------

    async def _on_auth(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another: each login its own task.
        task = asyncio.create_task(self._answer_login(msg))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer_login(self, msg: Msg) -> None:
        async with self._room:
            await self._answer_login_now(msg)

    async def _answer_login_now(self, msg: Msg) -> None:
        try:
            req = decode_request(msg.data)
        except ValueError as exc:
            log.warning("ignored a callout request: %s", exc)
            return
        try:
            answer = await self.admit(req)
        except Exception:  # the bucket unreachable: refused now, asked again at the retry
            log.exception("could not decide on %r from %s", req.user, req.host)
            answer = self.signer.deny(req, "the registrar could not read its records")
        await msg.respond(answer)

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
        log.warning("refused %r from %s: %s", req.user, req.host, reason)
        return self.signer.deny(req, reason)

    # -- joins ---------------------------------------------------------------------

    async def _on_join(self, msg: Msg) -> None:
        token_id = msg.subject.rsplit(".", 1)[1]
        try:
            answer = await self.join(token_id, decode(msg.data, JoinRequest))
        except ContractError as exc:
            answer = JoinAnswer(error=f"a bad join request: {exc}")
        except Exception:  # the bucket unreachable: nothing was used up; the machine may ask again
            log.exception("could not answer a join with token %s", token_id)
            answer = JoinAnswer(error="the registrar could not read its records; try again")
        if answer.error:
            log.warning("refused a join with token %s: %s", token_id, answer.error)
        await msg.respond(encode(answer))

    async def join(self, token_id: str, req: JoinRequest) -> JoinAnswer:
        if not 1 <= req.trainers <= MAX_TRAINERS:
            return JoinAnswer(error=f"trainers must be 1 to {MAX_TRAINERS}, not {req.trainers}")
        found = await self.registry.token(token_id)
        if found is None:
            return JoinAnswer(error="not a join token of this hub")
        token, revision = found
        if why := registry.refusal(token, time.time()):
            return JoinAnswer(error=why)
        if token.site:
            return JoinAnswer(error="machines join the hub; a site's trainers join its leaf node")
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
        return Revoked(machine=done.id, closed=await close_all(self.system, done.id))
