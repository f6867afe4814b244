"""The callout's JWTs: what a server's request says, and answers a server accepts (signed by
the issuer, for that server and that nkey). The servers themselves decode them in
tests/services/registrar; here, the claims and signatures one by one."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import nkeys
import pytest

from shared.auth import Permissions
from shared.machines.callout import Request, Signer, decode_request, issuer_public, new_issuer_seed


def claims_of(token: str) -> dict[str, Any]:
    body = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))


def verified(token: str, seed: bytes) -> dict[str, Any]:
    """The claims, once the signature checks out against the key of `seed` (and the `jti`
    is the claims' own digest, as nats-io/jwt makes it)."""
    head, body, sig = token.split(".")
    raw_sig = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    assert nkeys.from_seed(seed).verify(f"{head}.{body}".encode(), raw_sig)
    assert json.loads(base64.urlsafe_b64decode(head + "==")) == {
        "typ": "JWT",
        "alg": "ed25519-nkey",
    }
    claims = claims_of(token)
    unsigned = {**claims, "jti": ""}
    digest = hashlib.sha256(json.dumps(unsigned, separators=(",", ":")).encode()).digest()
    assert claims["jti"] == base64.b32encode(digest).decode().rstrip("=")
    return claims


REQ = Request(server_id="NSERVER", user_nkey="UUSER", user="m-0123456789ab", password="pw")


def test_an_answer_admits_the_user_the_server_named_with_its_permissions() -> None:
    seed = new_issuer_seed()
    signer = Signer(seed)
    assert signer.issuer == issuer_public(seed) and signer.issuer.startswith("A")
    perms = Permissions(publish=("a.>",), subscribe=("_INBOX_m.>",), responses=True)
    answer = verified(signer.allow(REQ, "m-0123456789ab", perms, 60).decode(), seed)
    assert (answer["iss"], answer["sub"], answer["aud"]) == (signer.issuer, "UUSER", "NSERVER")
    assert answer["nats"]["type"] == "authorization_response"
    user = verified(answer["nats"]["jwt"], seed)
    assert (user["sub"], user["name"], user["aud"]) == ("UUSER", "m-0123456789ab", "$G")
    assert user["exp"] - user["iat"] == 60
    assert user["nats"]["pub"] == {"allow": ["a.>"]}
    assert user["nats"]["sub"] == {"allow": ["_INBOX_m.>"]}
    assert user["nats"]["resp"] == {"max": 1, "ttl": 0}


def test_a_refusal_carries_its_reason_and_no_user() -> None:
    seed = new_issuer_seed()
    answer = verified(Signer(seed).deny(REQ, "revoked").decode(), seed)
    assert answer["nats"]["error"] == "revoked" and "jwt" not in answer["nats"]


def test_a_request_is_read_from_the_servers_claims() -> None:
    claims = {
        "nats": {
            "server_id": {"id": "NSERVER", "name": "hub-1"}, "user_nkey": "UUSER",
            "connect_opts": {"user": "join-0123456789ab", "pass": "s3cret"},
            "client_info": {"host": "10.0.0.7"},
        }
    }  # fmt: skip
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    req = decode_request(f"e30.{body}.sig".encode())
    assert req == Request(
        server_id="NSERVER", user_nkey="UUSER", user="join-0123456789ab", password="s3cret",
        host="10.0.0.7",
    )  # fmt: skip
    for bad in (b"", b"not a jwt", b"a.e30.c"):
        with pytest.raises(ValueError, match="not an authorization request"):
            decode_request(bad)
