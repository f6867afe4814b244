"""A client command's requests ride a silent JetStream, on a real nats-server: what is safe to
ask again is asked again, once it is answered the command goes on, and it said once on stderr
that it waited; what cannot be asked again, or asks a stream that does not exist, fails at
once. (The 3-node hub losing its leaders, end to end: tests/e2e/test_cluster.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError

from baton.client import calls as client
from baton.client import reader
from baton.client.patience import PatientClient, patiently, repeatable
from baton.stack.natsserver import NatsServer
from shared.bus import names, streams


@pytest.mark.parametrize(
    ("subject", "headers", "again"),
    [
        ("$JS.API.STREAM.INFO.KV_baton_runs", None, True),
        ("$JS.API.DIRECT.GET.KV_baton_runs.$KV.baton_runs.r1", None, True),
        ("$JS.API.CONSUMER.CREATE.BATON_EVENTS", None, True),  # the server names it
        ("$JS.API.CONSUMER.CREATE.BATON_EVENTS.read-1.baton.events.r1", None, False),
        ("$JS.API.CONSUMER.DELETE.BATON_EVENTS.read-1", None, False),
        ("$JS.API.STREAM.MSG.DELETE.BATON_EVENTS", None, False),
        ("$JS.hub.API.STREAM.INFO.KV_baton_runs", None, False),  # across a site's link
        ("baton.submit.default.operator", {"Nats-Msg-Id": "k1"}, True),
        ("$KV.baton_drains.trainer-1", None, False),  # a write without a message id
    ],
)
def test_what_is_asked_again(subject: str, headers: dict[str, str] | None, again: bool) -> None:
    assert repeatable(subject, headers) is again


async def patient(url: str, said: list[float], patience_s: float = 30.0) -> PatientClient:
    nc = PatientClient(said.append, patience_s)
    await nc.connect(url, allow_reconnect=False)
    return nc


@pytest.fixture
async def plain_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A real nats-server without JetStream, where a test's own responder answers JetStream's
    API subjects (as a stream that has lost its leader, it lets some asks go unanswered)."""
    server = NatsServer(tmp_path / "plain", port=0, jetstream=False)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_a_read_unanswered_for_a_while_is_answered_and_waiting_is_said_once(
    plain_server: NatsServer,
) -> None:
    """The first two asks go unanswered, as while a stream elects its leader; the third is
    answered."""
    nats_server = plain_server
    asked = 0
    responder = await client.open_nats(nats_server.url)

    async def answer(msg: Msg) -> None:
        nonlocal asked
        asked += 1
        if asked > 2:
            await msg.respond(b'{"ok": true}')

    await responder.subscribe("$JS.API.STREAM.INFO.ELECTING", cb=answer)
    await responder.flush()
    said: list[float] = []
    nc = await patient(nats_server.url, said)
    try:
        msg = await nc.request("$JS.API.STREAM.INFO.ELECTING", b"", timeout=5)
        assert json.loads(msg.data) == {"ok": True} and asked == 3
        await nc.request("$JS.API.STREAM.INFO.ELECTING", b"", timeout=5)
        assert said == [30.0], "waiting is said once, however often the command waits"
    finally:
        await nc.close()
        await responder.close()


async def test_what_is_not_asked_again_fails_at_the_first_silence(
    plain_server: NatsServer,
) -> None:
    said: list[float] = []
    nc = await patient(plain_server.url, said)
    sub = await nc.subscribe("$JS.API.CONSUMER.DELETE.S.c")  # hears it, never answers
    try:
        with pytest.raises(NatsTimeoutError):
            await nc.request("$JS.API.CONSUMER.DELETE.S.c", b"", timeout=0.5)
        assert said == []
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_a_submission_no_stream_takes_fails_at_once(nats_server: NatsServer) -> None:
    """No Baton service has declared its streams: a publish with a message id gets no
    responders, and JetStream says no stream takes the subject, so it is an error now, not
    after the patience runs out."""
    said: list[float] = []
    nc = await patient(nats_server.url, said, patience_s=600.0)
    try:
        publish = nc.jetstream().publish(
            "baton.submit.default.operator", b"{}", headers={"Nats-Msg-Id": "k1"}
        )
        with pytest.raises(NoStreamResponseError):
            await asyncio.wait_for(publish, 60)  # against a hang: a wait would be 600 s
        assert said == []
    finally:
        await nc.close()


async def test_a_reader_makes_its_consumer_afresh_and_reads_the_slice(
    nats_server: NatsServer,
) -> None:
    """`patiently` makes an operation again, as new, while JetStream is silent: here the
    first attempt is made to time out, the second reads the events stream."""
    said: list[float] = []
    nc = await patient(nats_server.url, said)
    try:
        js = nc.jetstream()
        await streams.ensure(js)
        await js.publish(names.event_subject("r1", "started"), b"one")
        tries = 0

        async def attempt() -> reader.StreamReader:
            nonlocal tries
            tries += 1
            if tries == 1:
                raise NatsTimeoutError
            return await reader.read(nc, names.EVENTS_STREAM, names.events_of_run("r1"))

        sub = await patiently(nc, attempt)
        try:
            assert [m.data for m in await reader.drain(sub)] == [b"one"]
        finally:
            await sub.unsubscribe()
        assert tries == 2 and said == [30.0]
    finally:
        await nc.close()
