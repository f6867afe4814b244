"""The notifier against a real nats-server under `baton up`'s authorization (it logs in as
its own role) and a real HTTP receiver: who is told, once each, through a receiver's outage
and the notifier's own restart; a refusal dead-lettered, not retried."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from nats.aio.client import Client

from services.notifier import config as alerts_config
from services.notifier.service import Notifier
from shared import config
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, convert, decode, encode, spec_hash
from shared.contracts.events import Failed, Progress, RunWarning
from shared.contracts.letters import DeadLetter
from shared.state.runs import Runs
from tests.services.notifier.receiver import Receiver
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually


@asynccontextmanager
async def notifier(hub: AuthorizedHub, alerts: alerts_config.Alerts) -> AsyncIterator[Notifier]:
    """A notifier serving as the `notifier` user, until the block ends."""
    nc = await hub.connect("notifier")
    n = Notifier(nc, config.load({}), alerts)
    await n.start()
    stop = asyncio.Event()
    serving = asyncio.create_task(n.serve(stop))
    try:
        yield n
    finally:
        stop.set()
        await serving
        await n.close()
        await nc.close()


def alerts_for(tmp_path: Path, text: str) -> alerts_config.Alerts:
    path = tmp_path / "alerts.toml"
    path.write_text(text)
    return alerts_config.load(str(path))


@asynccontextmanager
async def receiving() -> AsyncIterator[Receiver]:
    r = Receiver()
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def publish(nc: Client, event: Failed | RunWarning | Progress | dict[str, object]) -> None:
    run_id = event["run_id"] if isinstance(event, dict) else event.run_id
    kind = event["type"] if isinstance(event, dict) else type(event).__struct_config__.tag
    assert isinstance(run_id, str) and isinstance(kind, str)
    await nc.jetstream().publish(names.event_subject(run_id, kind), encode(event))


async def drained(nc: Client) -> None:
    """Until the notifier's consumer holds nothing: every event acked, none to come again."""

    async def empty() -> bool:
        info = await nc.jetstream().consumer_info(names.EVENTS_STREAM, names.NOTIFIER_CONSUMER)
        return bool(info.num_ack_pending == 0 and info.num_pending == 0)

    await eventually(empty, 60, "the notifier's consumer to drain", every=0.2)


async def record(nc: Client, run_id: str, pool: str) -> None:
    spec = convert(
        {"name": f"job-{run_id}", "entry_point": "m:f", "total_steps": 5, "pool": pool}, JobSpec
    )
    now = time.time()
    made = RunRecord(
        run_id=run_id, spec=spec, spec_hash=spec_hash(spec), created_at=now, updated_at=now
    )
    assert await (await Runs.open(nc.jetstream())).create(made)


async def test_each_pool_s_receivers_are_told_of_what_they_want_once(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    operator = await authorized.connect("operator")
    async with receiving() as rx:
        alerts = alerts_for(
            tmp_path,
            f"""
            [[pools.gpu.webhooks]]
            url = "{rx.url("/gpu-json")}"
            [[pools.gpu.webhooks]]
            url = "{rx.url("/gpu-am")}"
            format = "alertmanager"
            kinds = ["failed"]
            [[pools."*".webhooks]]
            url = "{rx.url("/any")}"
            format = "slack"
            """,
        )
        await record(operator, "rgpu", "gpu")
        async with notifier(authorized, alerts):
            await publish(operator, Progress(run_id="rgpu", step=1, total_steps=5))
            await publish(operator, RunWarning(run_id="rgpu", kind="soft_timeout", detail="x"))
            await publish(operator, RunWarning(run_id="rgpu", kind="stalled", detail="quiet"))
            await publish(operator, Failed(run_id="rgpu", reason="user code failed"))
            await publish(operator, Failed(run_id="rnorecord", reason="hard_timeout"))
            await rx.wait(lambda: len(rx.requests) >= 4, "four notifications")
            await drained(operator)
        assert rx.got("/gpu-json", lambda b: b["kind"] == "stalled") == 1
        assert rx.got("/gpu-json", lambda b: b["kind"] == "failed" and b["pool"] == "gpu") == 1
        assert rx.got("/gpu-am", lambda b: b["alerts"][0]["labels"]["kind"] == "failed") == 1
        assert rx.got("/any", lambda b: "rnorecord" in b["text"]) == 1
        assert len(rx.requests) == 4, [(r.path, r.body) for r in rx.requests]
        sent = next(r for r in rx.requests if r.path == "/gpu-json")
        assert sent.headers["Content-Type"] == "application/json"
        assert sent.headers["Idempotency-Key"] == f"baton-{sent.body['id']}"


async def test_a_receiver_that_was_down_is_told_once_across_a_restart(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    operator = await authorized.connect("operator")
    async with receiving() as rx:
        alerts = alerts_for(
            tmp_path,
            f"""
            [[pools."*".webhooks]]
            url = "{rx.url("/up")}"
            [[pools."*".webhooks]]
            url = "{rx.url("/down")}"
            name = "pager"
            """,
        )
        rx.answers["/down"] = 503
        async with notifier(authorized, alerts):
            await publish(operator, Failed(run_id="r1", reason="user code failed"))
            await rx.wait(lambda: rx.tried("/down") >= 2, "a retry of the receiver that is down")
        # The event is still the consumer's (nak'ed with a delay); a new notifier takes it.
        async with notifier(authorized, alerts):
            await rx.wait(lambda: rx.tried("/down") >= 3, "a retry by the restarted notifier")
            rx.answers["/down"] = 200
            await rx.wait(lambda: rx.got("/down") == 1, "the receiver, back, to be told")
            await drained(operator)
        assert rx.tried("/up") == 1, "the receiver that was up was told again"
        assert rx.got("/down") == 1


async def test_a_refusal_is_dead_lettered_and_not_retried(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    operator = await authorized.connect("operator")
    async with receiving() as rx:
        alerts = alerts_for(
            tmp_path,
            f"""
            [[pools."*".webhooks]]
            url = "{rx.url("/good")}"
            [[pools."*".webhooks]]
            url = "{rx.url("/bad/SECRET-TOKEN")}"
            format = "slack"
            """,
        )
        rx.answers["/bad/SECRET-TOKEN"] = 400
        async with notifier(authorized, alerts):
            await publish(operator, Failed(run_id="r1", reason="user code failed"))
            await drained(operator)
        assert rx.got("/good") == 1
        assert rx.tried("/bad/SECRET-TOKEN") == 1, "a refusal was tried again"
        msg = await operator.jetstream().get_last_msg(
            names.DLQ_STREAM, names.dlq_subject("notifier")
        )
        letter = decode(msg.data or b"", DeadLetter)
        assert letter.source == "notifier" and letter.subject == names.event_subject("r1", "failed")
        assert "HTTP 400" in letter.reason and "refused: bad payload" in letter.reason
        assert "127.0.0.1#" in letter.reason and letter.headers["Baton-Receiver"] in letter.reason
        assert "SECRET" not in letter.reason + str(letter.headers), "the URL's secret leaked"
        assert decode(letter.payload, Failed).reason == "user code failed"
