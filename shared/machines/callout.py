"""The wire side of NATS's auth callout: the servers' authorization requests and the
registrar's answers, both JWTs signed with nkeys (ed25519).

A hub server configured with `auth_callout` (`shared.auth.callout_block`) sends every
connection whose user it does not know itself to `$SYS.REQ.USER.AUTH`, as a JWT naming the
connection's credentials, the server's id and an nkey it made for the user. The answer is an
`authorization_response` JWT for that server and that nkey, carrying a user JWT — the
user's name, account and permissions — or an error; both are signed with the account key
whose public half the servers' configuration names as the callout's issuer. Nothing here
talks to NATS; `services/registrar` does.

The claims follow nats-io/jwt v2 (what the servers decode): `jti` is the base32 of the
sha256 of the claims without it. `nkeys` (nats-io's own) signs; decoding a request checks no
signature, as the request reaches only the callout's own subscription.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import msgspec
import nkeys

from shared.auth import Permissions

ACCOUNT = "$G"
"""The account the hub's users live in: the one a `authorization { users }` block makes."""
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """What a server asks: who the connection says it is, for which server and nkey."""

    server_id: str
    user_nkey: str
    user: str
    password: str
    host: str = ""


def new_issuer_seed() -> bytes:
    """A fresh account seed (`SA…`): the key the callout's answers are signed with."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))


def issuer_public(seed: bytes) -> str:
    return str(nkeys.from_seed(seed).public_key.decode())


def decode_request(token: bytes) -> Request:
    """A server's authorization request. Raises ValueError when it is not one."""
    try:
        claims = json.loads(_unb64(token.decode().split(".")[1]))
        n = claims["nats"]
        opts = n.get("connect_opts", {})
        return Request(
            server_id=n["server_id"]["id"], user_nkey=n["user_nkey"],
            user=opts.get("user", ""), password=opts.get("pass", ""),
            host=n.get("client_info", {}).get("host", ""),
        )  # fmt: skip
    except (IndexError, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not an authorization request: {exc}") from None


class Signer:
    """Answers requests with the issuer's seed."""

    def __init__(self, seed: bytes) -> None:
        self._kp = nkeys.from_seed(seed)
        self.issuer = str(self._kp.public_key.decode())

    def allow(self, req: Request, name: str, perms: Permissions, expires_s: float = 0) -> bytes:
        """Admit the connection as user `name` with `perms` (an `expires_s` > 0 makes the
        server close it then, unless it reconnects through the callout again)."""
        now = int(time.time())
        user: dict[str, Any] = {
            "pub": {"allow": list(perms.publish)},
            "sub": {"allow": list(perms.subscribe)},
            "type": "user",
            "version": 2,
        }
        if perms.responses:
            user["resp"] = {"max": 1, "ttl": 0}
        claims: dict[str, Any] = {
            "iat": now, "iss": self.issuer, "sub": req.user_nkey, "name": name,
            "aud": ACCOUNT, "nats": user,
        }  # fmt: skip
        if expires_s > 0:
            claims["exp"] = now + int(expires_s)
        return self._answer(req, {"jwt": self._sign(claims)})

    def deny(self, req: Request, reason: str) -> bytes:
        """Refuse the connection; the server logs `reason`, the client sees only that it
        was refused."""
        return self._answer(req, {"error": reason})

    def _answer(self, req: Request, body: dict[str, Any]) -> bytes:
        claims = {
            "iat": int(time.time()), "iss": self.issuer, "sub": req.user_nkey,
            "aud": req.server_id,
            "nats": {**body, "type": "authorization_response", "version": 2},
        }  # fmt: skip
        return self._sign(claims).encode()

    def _sign(self, claims: dict[str, Any]) -> str:
        claims = {**claims, "jti": ""}
        claims["jti"] = base64.b32encode(hashlib.sha256(_compact(claims)).digest()).decode()
        claims["jti"] = claims["jti"].rstrip("=")
        head = _b64(_compact(_HEADER))
        body = _b64(_compact(claims))
        sig = self._kp.sign(f"{head}.{body}".encode())
        return f"{head}.{body}.{_b64(sig)}"


def _compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
