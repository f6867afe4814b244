"""Join tokens and machines in the `baton_machines` bucket, and the secrets they stand for.

A token is `bj1.<id>.<secret>`: its id names its record (`token.<id>`), its secret is checked
against the record's digest. A machine's NATS user is its id (`m-<hex>`), its password a
secret made when it joined. Every change of a record is a compare-and-swap on its revision:
two machines joining with one token at the same instant, one wins; a revocation and a
join never overwrite each other.

Who writes what: an operator creates tokens (`baton token create`, any client with the
operator's rights); the registrar marks a token used and creates the machine
(`services/registrar`); the registrar revokes, at an operator's request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NoKeysError

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import decode, encode
from shared.contracts.machines import JoinToken, Machine
from shared.errors import ContractError

TOKEN_PREFIX = "bj1"
MACHINE_PREFIX = "m-"
JOINER_PREFIX = "join-"
"""The NATS user a new machine connects as with its token, before it has an identity."""
R = TypeVar("R", Machine, JoinToken)
_ID = re.compile(r"^[0-9a-f]{12}$")


class TokenError(ValueError):
    """A token that is not one: malformed, or not of this hub."""


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, want: str) -> bool:
    return hmac.compare_digest(digest(secret), want)


def token_text(token_id: str, secret: str) -> str:
    return f"{TOKEN_PREFIX}.{token_id}.{secret}"


def parse_token(text: str) -> tuple[str, str]:
    """(id, secret) of a token as `baton token create` printed it."""
    parts = text.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or not _ID.match(parts[1]) or not parts[2]:
        raise TokenError("not a join token (they look like bj1.<12 hex>.<secret>)")
    return parts[1], parts[2]


def joiner_user(token_id: str) -> str:
    return f"{JOINER_PREFIX}{token_id}"


def is_machine(user: str) -> bool:
    return user.startswith(MACHINE_PREFIX) and bool(_ID.match(user.removeprefix(MACHINE_PREFIX)))


def new_id() -> str:
    return secrets.token_hex(6)


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def refusal(token: JoinToken, now: float) -> str:
    """Why `token` may not be used now; empty when it may."""
    if token.used_by:
        return f"this token was used already, by machine {token.used_by}; ask for a new one"
    if now >= token.expires_at:
        return "this token has expired; ask for a new one (`baton token create`)"
    return ""


def revoked_in(data: bytes) -> Machine | None:
    """The machine a record of the bucket (or of a site's copy) holds, if it is revoked;
    None for anything else: a deletion, a record that breaks its contract, a live one."""
    if not data:
        return None
    try:
        machine = decode(data, Machine)
    except ContractError:
        return None
    return machine if machine.revoked else None


class Registry:
    """The bucket's records, read by key and changed by compare-and-swap."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._writer = KvWriter(js, names.MACHINES_BUCKET)

    async def create_token(
        self, pool: str, ttl_s: float, site: str = "", by: str = ""
    ) -> tuple[JoinToken, str]:
        """A new token's record and its text (the only copy of its secret)."""
        token_id, secret, now = new_id(), new_secret(), time.time()
        token = JoinToken(
            id=token_id, digest=digest(secret), pool=pool, site=site, created_at=now,
            expires_at=now + ttl_s, created_by=by,
        )  # fmt: skip
        if await self._writer.put(f"token.{token_id}", encode(token), expected=0) is None:
            raise RuntimeError("a token of that id exists already; create another")
        return token, token_text(token_id, secret)

    async def token(self, token_id: str) -> tuple[JoinToken, int] | None:
        return await self._get(f"token.{token_id}", JoinToken)

    async def machine(self, machine_id: str) -> tuple[Machine, int] | None:
        return await self._get(f"machine.{machine_id}", Machine)

    async def use_token(self, token: JoinToken, revision: int, machine: Machine) -> bool:
        """Mark `token` used by `machine` and record the machine: False when the token
        changed since it was read at `revision` (another machine took it first)."""
        used = msgspec.structs.replace(token, used_by=machine.id, used_at=machine.joined_at)
        if await self._writer.put(f"token.{token.id}", encode(used), expected=revision) is None:
            return False
        await self._writer.put(f"machine.{machine.id}", encode(machine), expected=0)
        return True

    async def revoke(self, machine_id: str, by: str) -> Machine | None:
        """Mark the machine revoked (once; a second revocation changes nothing). None when
        there is no such machine."""
        for _ in range(5):
            found = await self.machine(machine_id)
            if found is None:
                return None
            m, revision = found
            if m.revoked:
                return m
            done = msgspec.structs.replace(m, revoked_at=time.time(), revoked_by=by)
            key = f"machine.{machine_id}"
            if await self._writer.put(key, encode(done), expected=revision) is not None:
                return done
        raise RuntimeError(f"{machine_id} kept changing; try again")

    async def machines(self) -> list[Machine]:
        return await self._all("machine.", Machine)

    async def tokens(self) -> list[JoinToken]:
        return await self._all("token.", JoinToken)

    async def _all(self, prefix: str, kind: type[R]) -> list[R]:
        kv = await self.js.key_value(names.MACHINES_BUCKET)
        out: list[R] = []
        try:
            keys = [k for k in await kv.keys(filters=[prefix]) if k.startswith(prefix)]
        except NoKeysError:
            return []
        for key in keys:
            found = await self._get(key, kind)
            if found is not None:
                out.append(found[0])
        return out

    async def _get(self, key: str, kind: type[R]) -> tuple[R, int] | None:
        kv = await self.js.key_value(names.MACHINES_BUCKET)
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value or entry.revision is None:
            return None
        try:
            return decode(entry.value, kind), entry.revision
        except ContractError:
            return None
