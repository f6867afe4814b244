"""The registrar against a real hub server that asks it about every user it does not know
(`baton up --machines`'s authorization): joins, machines' logins, revocations, people.

The registrar runs in the test's process as its own role; new machines, people and the
operator are clients of their own, so every answer is the server's, through the callout."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from baton.stack.authority import callout_seed
from services.registrar.service import Registrar
from shared.auth import SYSTEM_USER
from shared.bus import names
from shared.config import Settings
from shared.contracts import decode, encode
from shared.contracts.checkpoints import StoreInfo
from shared.contracts.machines import JoinAnswer, JoinRequest, Revoke, Revoked
from shared.credentials import Credentials, options_for
from shared.machines.registry import Registry, joiner_user, parse_token
from shared.state.hub import say_store
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[AuthorizedHub]:
    h = AuthorizedHub(tmp_path / "hub", machines=True)
    # Logins this module refuses on purpose: forged tokens, revoked machines, wrong words.
    h.audit.allow_server(
        "authentication error|Authorization Violation|Auth callout|Publish Violation",
        "credentials and rights refused on purpose",
    )
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


async def start_registrar(hub: AuthorizedHub) -> Registrar:
    nc = await hub.connect("registrar")
    registrar = Registrar(
        nc, Settings(nats_url=hub.url), callout_seed(hub.vault).read_bytes().strip(),
        hub.vault.get(SYSTEM_USER), hub.vault.root,
    )  # fmt: skip
    await registrar.start()
    return registrar


@pytest.fixture
async def registrar(hub: AuthorizedHub) -> AsyncIterator[Registrar]:
    r = await start_registrar(hub)
    op = await hub.connect("operator")
    await say_store(op.jetstream(), StoreInfo(url="s3://bucket/runs", s3_endpoint="http://s3"))
    try:
        yield r
    finally:
        await r.close()


async def login(url: str, user: str, password: str) -> Client | None:
    """A connection as `user`, None if the server refused it."""
    try:
        return await nats.connect(
            url, allow_reconnect=False, connect_timeout=5,
            **options_for(Credentials(user, password)),
        )  # fmt: skip
    except nats.errors.Error as exc:
        assert "Authorization Violation" in str(exc), repr(exc)
        return None


async def join(hub: AuthorizedHub, token: str, trainers: int = 1) -> JoinAnswer:
    token_id, secret = parse_token(token)
    nc = await login(hub.url, joiner_user(token_id), secret)
    assert nc is not None, "a genuine token logs in to ask"
    try:
        ask = JoinRequest(host="box", trainers=trainers)
        reply = await nc.request(names.join_subject(token_id), encode(ask), timeout=5)
        return decode(reply.data, JoinAnswer)
    finally:
        await nc.close()


async def token(hub: AuthorizedHub, ttl_s: float = 600, site: str = "") -> str:
    op = await hub.connect("operator")
    return (await Registry(op.jetstream()).create_token("default", ttl_s, site=site))[1]


async def test_a_machine_joins_once_and_logs_in_as_itself(
    hub: AuthorizedHub, registrar: Registrar
) -> None:
    text = await token(hub)
    answer = await join(hub, text, trainers=2)
    assert not answer.error and answer.machine.startswith("m-") and answer.pool == "default"
    assert answer.store == StoreInfo(url="s3://bucket/runs", s3_endpoint="http://s3")
    again = await join(hub, text)
    assert again.error.startswith(f"this token was used already, by machine {answer.machine}")

    refused: list[str] = []

    async def heard(exc: Exception) -> None:
        refused.append(str(exc))

    nc = await nats.connect(
        hub.url, error_cb=heard, **options_for(Credentials(answer.machine, answer.secret))
    )
    try:
        # Its own heartbeats are taken; another machine's refused by the server.
        ack = await nc.jetstream().publish(
            f"$KV.{names.WORKERS_BUCKET}.{answer.machine}-trainer-2", b"{}"
        )
        assert ack.seq > 0
        await nc.publish(f"$KV.{names.WORKERS_BUCKET}.m-000000000000-trainer-1", b"{}")
        await nc.flush()

        async def told() -> bool:
            return any("permissions violation" in r.lower() for r in refused)

        await eventually(told, 5, "the server to refuse another machine's heartbeat")
    finally:
        await nc.close()
    assert await login(hub.url, answer.machine, "a guess") is None
    machines = await Registry((await hub.connect("operator")).jetstream()).machines()
    assert [(m.id, m.trainers, m.host) for m in machines] == [(answer.machine, 2, "box")]


async def test_tokens_forged_expired_or_for_a_site_are_refused(
    hub: AuthorizedHub, registrar: Registrar
) -> None:
    text = await token(hub)
    token_id, secret = parse_token(text)
    assert await login(hub.url, joiner_user(token_id), secret[:-1] + "x") is None
    assert await login(hub.url, joiner_user("0" * 12), secret) is None
    late = await token(hub, ttl_s=-1)
    assert "expired" in (await join(hub, late)).error
    site = await token(hub, site="lab1")
    assert "this token is for site lab1: join at its leaf node" in (await join(hub, site)).error
    assert "trainers must be 1 to 64" in (await join(hub, text, trainers=0)).error
    # Refused asks use nothing up: the token still joins.
    assert not (await join(hub, text)).error


async def test_a_machine_joins_a_site_through_its_registrar_and_logs_in_there_only(
    hub: AuthorizedHub, registrar: Registrar
) -> None:
    """A join a site's registrar passes on (`services/registrar/site.py`) makes a machine of
    that site, which the hub itself refuses: it logs in at its site's leaf node."""
    text = await token(hub, site="lab1")
    token_id, _ = parse_token(text)
    hub_token_id, _ = parse_token(await token(hub))
    ask = JoinRequest(host="box", trainers=1)
    assert "for the hub, not lab1" in (await registrar.join(hub_token_id, ask, "lab1")).error
    answer = await registrar.join(token_id, ask, "lab1")
    assert not answer.error and answer.site == "lab1", answer
    machine = await Registry((await hub.connect("operator")).jetstream()).machine(answer.machine)
    assert machine is not None and machine[0].site == "lab1"
    assert await login(hub.url, answer.machine, answer.secret) is None


async def test_a_revoked_machine_is_closed_and_refused(
    hub: AuthorizedHub, registrar: Registrar
) -> None:
    answer = await join(hub, await token(hub))
    held = [await login(hub.url, answer.machine, answer.secret) for _ in range(2)]
    op = await hub.connect("operator")
    ask = encode(Revoke(machine=answer.machine, by="test"))
    done = decode((await op.request(names.REVOKE_SUBJECT, ask, timeout=10)).data, Revoked)
    assert done == Revoked(machine=answer.machine, closed=2)
    assert all(nc is not None and nc.is_closed for nc in held)
    assert await login(hub.url, answer.machine, answer.secret) is None
    unknown = encode(Revoke(machine="m-000000000000"))
    done = decode((await op.request(names.REVOKE_SUBJECT, unknown, timeout=10)).data, Revoked)
    assert done.error == "no machine m-000000000000"


async def test_a_registrar_starting_closes_what_a_revocation_left_open(
    hub: AuthorizedHub, registrar: Registrar
) -> None:
    answer = await join(hub, await token(hub))
    held = await login(hub.url, answer.machine, answer.secret)
    assert held is not None
    op = await hub.connect("operator")
    # Revoked in the record only: the registrar that would have closed it died first.
    await Registry(op.jetstream()).revoke(answer.machine, "test")
    assert held.is_connected
    second = await start_registrar(hub)
    try:

        async def closed() -> bool:
            return held.is_closed

        await eventually(closed, 10, "the revoked machine's connection to close")
    finally:
        await second.close()


async def test_the_stacks_people_are_asked_of_it(hub: AuthorizedHub, registrar: Registrar) -> None:
    people = hub.vault.root / "people.json"
    dana = hub.vault.get("dana")
    assert await login(hub.url, "dana", dana.password) is None, "not a person yet"
    people.write_text(json.dumps(["dana"]))
    nc = await login(hub.url, "dana", dana.password)
    assert nc is not None
    await nc.close()
    assert await login(hub.url, "dana", "a guess") is None
    people.write_text("[]")
    assert await login(hub.url, "dana", dana.password) is None
