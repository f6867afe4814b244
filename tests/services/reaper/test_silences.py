"""The reaper hands a run over when its trainer's pulse stops (`silences.py`) and the moment
the server says its connection closed (`departures.py`) — each only while the record still
names that trainer's attempt, and never for a trainer that keeps pulsing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.js import JetStreamContext

from services.reaper.departures import Departures, departed_worker
from services.reaper.silences import Silences
from shared.auth import DEPARTURES_USER, DISCONNECTS
from shared.bus import names
from shared.bus.streams import ensure_consumer, trainer_consumer
from shared.config import Settings
from shared.contracts import encode
from shared.contracts.control import ClientInfo, Disconnected, Pulse
from shared.state.lease import holder
from shared.state.runs import Runs
from tests.services.reaper.test_lapses import ACK_WAIT_S, handovers, held
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

QUICK = Settings(pulse_s=0.2, silent_after_s=0.6)


def test_only_a_trainer_process_gone_is_a_departure() -> None:
    def gone(name: str, user: str, reason: str = "Client Closed") -> str | None:
        return departed_worker(Disconnected(client=ClientInfo(name=name, user=user), reason=reason))

    assert gone("baton-trainer-t1", "trainer") == "t1"
    assert gone("baton-trainer-t1", "trainer", "Read Error") == "t1"
    assert gone("baton-trainer-m-0a-trainer-1", "m-0a") == "m-0a-trainer-1"
    # A server that shut down, or gave up on a connection whose process may live.
    for reason in ("Server Shutdown", "Stale Connection", "Slow Consumer (Write Deadline)"):
        assert gone("baton-trainer-t1", "trainer", reason) is None
    assert gone("baton-dispatcher", "dispatcher") is None
    # No one speaks for a trainer that is not theirs.
    assert gone("baton-trainer-t1", "submitter") is None
    assert gone("baton-trainer-m-0a-trainer-1", "m-0b") is None


@contextlib.asynccontextmanager
async def pulsing(
    hub: AuthorizedHub, worker: str, run_id: str, token: int
) -> AsyncIterator[Client]:
    """A trainer's connection (its name, the trainer role) pulsing for `run_id` until the
    block ends; the connection is left open for the test to close."""
    nc = await hub.connect("trainer", name=f"baton-trainer-{worker}")
    pulse = encode(Pulse(worker=worker, run_id=run_id, token=token))

    async def beat() -> None:
        while not nc.is_closed:
            await nc.publish(names.pulse_subject(worker), pulse)
            await asyncio.sleep(QUICK.pulse_s)

    task = asyncio.create_task(beat())
    try:
        yield nc
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def watching(
    authorized: AuthorizedHub, settings: Settings
) -> tuple[JetStreamContext, Runs, Silences]:
    """The test's side (the operator: the runs, the task queue) and the reaper's watch, as
    the reaper role, not yet started."""
    nc = await authorized.connect("operator")
    js = nc.jetstream()
    await ensure_consumer(js, names.TASKS_STREAM, trainer_consumer("default", ACK_WAIT_S, 100))
    reaper = await authorized.connect("reaper")
    rjs = reaper.jetstream()
    return js, await Runs.open(js), Silences(reaper, rjs, await Runs.open(rjs), None, settings)


async def test_a_silent_trainer_loses_its_run_and_one_that_pulses_keeps_it(
    authorized: AuthorizedHub,
) -> None:
    js, runs, silences = await watching(authorized, QUICK)
    await silences.start()
    try:
        alive, _ = await held(js, runs, "ralive", ttl_s=600, worker="w1")
        async with pulsing(authorized, "w1", "ralive", alive.token):
            lost, _ = await held(js, runs, "rlost", ttl_s=600, worker="w2")
            async with pulsing(authorized, "w2", "rlost", lost.token):
                await eventually(lambda: _heard(silences, "w2"), 10, "the pulse heard")
            # w2 fell silent; w1 pulses on, and keeps its run and its lease.
            await eventually(lambda: _handed(runs, "rlost"), 20, "the silent run handed over")
            assert await handovers(js, "ralive") == []
            assert await holder(js, "ralive") == "w1"
        [event] = await handovers(js, "rlost")
        assert (event.worker, event.token) == ("w2", lost.token) and "no pulse" in event.reason
        assert await holder(js, "rlost") is None, "its lease was freed for the next attempt"
    finally:
        await silences.stop()


async def test_a_trainer_whose_connection_closes_is_handed_over_at_once(
    authorized: AuthorizedHub,
) -> None:
    # Silence alone would take an hour: only the departure can hand it over in this test.
    js, runs, silences = await watching(authorized, Settings(pulse_s=0.2, silent_after_s=3600))
    await silences.start()
    departures = Departures(authorized.url, silences, authorized.vault.get(DEPARTURES_USER))
    await departures.start()
    try:
        lease, _ = await held(js, runs, "rgone", ttl_s=600, worker="w2")
        # The departures connection is up once it hears an advisory: any client's close.
        probe = await authorized.connect("submitter", name="probe")
        await eventually(lambda: _listening(departures), 10, "the departures connection")
        await probe.close()
        async with pulsing(authorized, "w2", "rgone", lease.token) as trainer:
            await eventually(lambda: _heard(silences, "w2"), 10, "the pulse heard")
            # Another user's connection under the trainer's name closes: nothing happens.
            impostor = await authorized.connect("submitter", name="baton-trainer-w2")
            await impostor.close()
            await trainer.close()  # as its process exiting: the socket ends
            await eventually(lambda: _handed(runs, "rgone"), 10, "the hand-over")
        [event] = await handovers(js, "rgone")
        assert event.worker == "w2" and "connection closed (Client Closed)" in event.reason
        assert await holder(js, "rgone") is None
    finally:
        await departures.stop()
        await silences.stop()


async def test_the_departures_user_hears_disconnects_and_nothing_else(
    authorized: AuthorizedHub,
) -> None:
    authorized.audit.allow_server(
        r"departures.*Violation", "the test makes the departures user try what it may not"
    )
    nc = await authorized.connect(DEPARTURES_USER)
    heard: list[str] = []

    async def on(msg: object) -> None:
        heard.append(getattr(msg, "subject", ""))

    await nc.subscribe(DISCONNECTS, cb=on)
    errors: list[Exception] = []
    nc._error_cb = _collect(errors)  # the refusal comes as an async error
    await nc.subscribe("$SYS.REQ.SERVER.PING.CONNZ")
    await nc.flush()
    other = await authorized.connect("submitter", name="leaving")
    await other.close()
    await eventually(lambda: _nonempty(heard), 10, "a disconnect advisory")
    await eventually(lambda: _nonempty(errors), 10, "the refused subscription")
    assert "permissions violation" in str(errors[0]).lower(), errors


def _collect(errors: list[Exception]):  # type: ignore[no-untyped-def]
    async def cb(exc: Exception) -> None:
        errors.append(exc)

    return cb


async def _nonempty(items: list[object]) -> bool:
    return bool(items)


async def _handed(runs: Runs, run_id: str) -> bool:
    """The run's record no longer names a delivery: its attempt was handed over."""
    found = await runs.get(run_id)
    return found is not None and found[0].delivery is None


async def _heard(silences: Silences, worker: str) -> bool:
    return worker in silences.heard


async def _listening(departures: Departures) -> bool:
    return departures.nc is not None and departures.nc.is_connected
