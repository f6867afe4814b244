"""Join tokens and machines' records: the token's form, when it may be used, and that a
token is used once — two joins racing on it, one wins (a real nats-server's KV)."""

from __future__ import annotations

import time

import msgspec
import pytest
from nats.aio.client import Client

from shared.contracts.machines import JoinToken, Machine
from shared.machines import registry
from shared.machines.registry import Registry, TokenError, parse_token


def machine(machine_id: str, token: str = "t") -> Machine:
    return Machine(
        id=machine_id, host="box", pool="default", digest=registry.digest("s"), trainers=2,
        token=token, joined_at=time.time(),
    )  # fmt: skip


def test_a_token_is_its_id_and_secret_and_nothing_else() -> None:
    text = registry.token_text("0123456789ab", "s3cr-et_")
    assert parse_token(text) == ("0123456789ab", "s3cr-et_")
    assert parse_token(f"  {text}\n") == ("0123456789ab", "s3cr-et_")
    for bad in ("", "bj1.0123456789ab", "bj2.0123456789ab.x", "bj1.0123.x", "bj1.0123456789ab."):
        with pytest.raises(TokenError, match="not a join token"):
            parse_token(bad)


def test_a_token_may_be_used_once_and_before_it_expires() -> None:
    now = time.time()
    fresh = JoinToken(id="a", digest="d", pool="p", created_at=now, expires_at=now + 60)
    assert registry.refusal(fresh, now) == ""
    assert "expired" in registry.refusal(fresh, now + 61)
    used = msgspec.structs.replace(fresh, used_by="m-0123456789ab")
    assert "used already, by machine m-0123456789ab" in registry.refusal(used, now)


def test_secrets_are_kept_as_digests_and_compared_in_constant_time() -> None:
    want = registry.digest("s3cret")
    assert want != "s3cret" and registry.matches("s3cret", want)
    assert not registry.matches("s3cre", want)
    assert registry.is_machine("m-0123456789ab")
    assert not registry.is_machine("m-nothex") and not registry.is_machine("alice")


def test_a_machine_speaks_for_its_own_trainers_only() -> None:
    m = machine("m-0123456789ab")
    assert m.workers() == ("m-0123456789ab-trainer-1", "m-0123456789ab-trainer-2")


async def test_two_joins_racing_on_one_token_one_wins(declared: Client) -> None:
    reg = Registry(declared.jetstream())
    token, text = await reg.create_token("default", 60, by="op")
    assert parse_token(text)[0] == token.id
    found = await reg.token(token.id)
    assert found is not None and found[0] == token
    first = await reg.use_token(token, found[1], machine("m-000000000001", token.id))
    second = await reg.use_token(token, found[1], machine("m-000000000002", token.id))
    assert (first, second) == (True, False)
    used = await reg.token(token.id)
    assert used is not None and used[0].used_by == "m-000000000001"
    assert [m.id for m in await reg.machines()] == ["m-000000000001"]
    assert [t.id for t in await reg.tokens()] == [token.id]


async def test_a_revocation_is_recorded_once(declared: Client) -> None:
    reg = Registry(declared.jetstream())
    token, _ = await reg.create_token("default", 60)
    found = await reg.token(token.id)
    assert found is not None
    assert await reg.use_token(token, found[1], machine("m-000000000003", token.id))
    first = await reg.revoke("m-000000000003", "alice")
    assert first is not None and first.revoked and first.revoked_by == "alice"
    again = await reg.revoke("m-000000000003", "bob")
    assert again == first, "a second revocation changes nothing"
    assert await reg.revoke("m-00000000000f", "bob") is None
    assert await Registry(declared.jetstream()).machines() == [first]
