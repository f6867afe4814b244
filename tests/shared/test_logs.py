"""The condition logger: one line as a failure starts, one as it ends, nothing between."""

from __future__ import annotations

import logging

import pytest
from nats.aio.client import Client
from nats.js.errors import NoStreamResponseError

from shared.bus.connect import publish, where
from shared.logs import Condition


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="test.logs")
    return caplog


def lines(caplog: pytest.LogCaptureFixture, above: int = logging.DEBUG) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno > above]


def test_a_long_failure_logs_once_as_it_starts_and_once_as_it_ends(
    logged: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = logging.getLogger("test.logs")
    c = Condition(log, "r1: lease renewal", "training goes on", clock=clock)
    assert c.failed(TimeoutError()) is True
    for _ in range(99):
        clock.now += 0.5
        assert c.failed(TimeoutError()) is False
    assert c.failing and c.failures == 100
    clock.now += 0.5
    assert c.ok() is True
    assert lines(logged) == [
        (logging.WARNING, "r1: lease renewal failed (TimeoutError); training goes on"),
        (logging.INFO, "r1: lease renewal recovered after 50.0s (100 tries failed)"),
    ]
    assert len([r for r in logged.records if r.levelno == logging.DEBUG]) == 99


def test_success_while_well_logs_nothing_and_a_new_failure_is_a_new_condition(
    logged: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    c = Condition(logging.getLogger("test.logs"), "publishes to X", clock=clock)
    assert c.ok() is False and not c.failing
    c.failed("no responders")
    clock.now += 2
    c.ok()
    c.ok()
    c.failed(OSError())
    assert c.failures == 1
    assert lines(logged) == [
        (logging.WARNING, "publishes to X failed (no responders)"),
        (logging.INFO, "publishes to X recovered after 2.0s (1 try failed)"),
        (logging.WARNING, "publishes to X failed (OSError)"),
    ]


def test_retried_publishes_share_one_condition_per_destination() -> None:
    lease = "$JS.hub.API.$KV.baton_leases"
    assert where(f"{lease}.r1.abc") == where(f"{lease}.r2.def") == lease
    assert where("baton.events.r1.progress") == where("baton.events.r2.started")
    assert where("baton.site.lab1.events.r1.progress") == "baton.site.lab1.events"
    assert where("baton.site.lab1.logs.r1") != where("baton.site.lab1.events.r1.progress")


async def test_a_cut_logs_the_retried_publishes_once(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A real server with no stream on the subject answers every publish with no
    responders, as a leaf cut off from the hub does; once a stream takes the subject, the
    next publish is stored and the failure said to be over — two lines for all of it."""
    caplog.set_level(logging.DEBUG, logger="baton.nats")
    js = nc.jetstream()
    subject = "baton.probe.r1"
    with pytest.raises(NoStreamResponseError):  # three tries, all unanswered
        await publish(js, subject, b"", msg_id="a", attempts=3)
    await js.add_stream(name="PROBE", subjects=["baton.probe.>"])
    await publish(js, subject, b"", msg_id="b")
    said = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    assert len(said) == 2, said
    where_ = where(subject)
    assert said[0].startswith(f"publishes to {where_} failed (NoStreamResponseError)"), said
    assert said[1].startswith(f"publishes to {where_} recovered after"), said
    assert "(3 tries" in said[1], said
