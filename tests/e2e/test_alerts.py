"""Alerts end to end: `baton up`'s stack with its notifier, under its default authorization,
and a real webhook receiver that is down for a while — each failure, stall and divergence is
told once to each receiver, and one told while it was down arrives once when it is back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.contracts import RunState
from tests.e2e.jobs import finished, job, paced, submit
from tests.services.notifier.receiver import Receiver
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.operations

FAST = {"BATON_SWEEP_INTERVAL": "0.5", "BATON_HEARTBEAT": "0.5"}
SERVICES = ("dispatcher", "checkpointer", "reaper", "trainer", "notifier")


def failing(entry: str, **limits: Any) -> Any:
    return job(
        entry_point=f"tests.support.workloads:{entry}",
        total_steps=50,
        limits={"max_retries": 0, **limits},
    )


def poisoned() -> Any:
    """A user-shaped job whose loss is infinite at step 12 (`tests.support.guarded`)."""
    return job(
        entry_point="tests.support.guarded:poisoned",
        total_steps=30,
        config={"poison": 100, "shuffle": False},
        checkpoint={"every_steps": 5},
        limits={"max_retries": 0},
    )


def told(rx: Receiver, run_id: str, kind: str) -> tuple[int, int]:
    """How many times each receiver (JSON, Alertmanager) was told of `kind` for the run."""
    plain = rx.got("/json", lambda b: b["run_id"] == run_id and b["kind"] == kind)
    am = rx.got(
        "/am",
        lambda b: (
            b["alerts"][0]["labels"].get("run_id") == run_id
            and b["alerts"][0]["labels"]["kind"] == kind
        ),
    )
    return plain, am


async def consumer(nc: Client) -> ConsumerInfo | None:
    try:
        info: ConsumerInfo = await nc.jetstream().consumer_info(
            names.EVENTS_STREAM, names.NOTIFIER_CONSUMER
        )
    except NotFoundError:
        return None
    return info


async def test_each_failure_stall_and_divergence_is_told_once_through_a_receiver_outage(
    tmp_path: Path,
) -> None:
    rx = Receiver()
    await rx.start()
    alerts = tmp_path / "alerts.toml"
    alerts.write_text(
        f'[[pools."*".webhooks]]\nurl = "{rx.url("/json")}"\n'
        f'[[pools."*".webhooks]]\nurl = "{rx.url("/am")}"\nformat = "alertmanager"\n'
    )
    stack = Stack(tmp_path / "stack", trainers=1, lease_ttl=3, env=FAST)
    stack.opts = msgspec.structs.replace(stack.opts, alerts=str(alerts))
    try:
        await stack.start(SERVICES)
        nc = await stack.client()
        await eventually(lambda: consumer(nc), 60, "the notifier's consumer")

        failed = await submit(nc, failing("boom"))
        assert (await finished(nc, failed)).state is RunState.FAILED
        await rx.wait(lambda: told(rx, failed, "failed") == (1, 1), "the failure told")

        stalled = await submit(nc, failing("stall", stall_timeout_s=2))
        assert (await finished(nc, stalled, timeout=120)).state is RunState.FAILED
        await rx.wait(lambda: told(rx, stalled, "stalled") == (1, 1), "the stall told")
        await rx.wait(lambda: told(rx, stalled, "failed") == (1, 1), "its failure told")

        # A divergence: the guard stops the run at the step its loss is not finite.
        diverged = await submit(nc, poisoned())
        assert (await finished(nc, diverged, timeout=120)).state is RunState.FAILED
        await rx.wait(lambda: told(rx, diverged, "guarded") == (1, 1), "the divergence told")
        await rx.wait(lambda: told(rx, diverged, "failed") == (1, 1), "its failure told")

        # The receiver goes down: a run fails, another trains to the end meanwhile.
        await rx.stop()
        while_down = await submit(nc, failing("boom"))
        completes = await submit(nc, paced(40))
        assert (await finished(nc, while_down)).state is RunState.FAILED
        assert (await finished(nc, completes, timeout=120)).state is RunState.COMPLETED

        async def retried() -> bool:
            info = await nc.jetstream().consumer_info(names.EVENTS_STREAM, names.NOTIFIER_CONSUMER)
            return bool(info.num_redelivered and info.num_ack_pending)

        await eventually(retried, 60, "the notifier to try the receiver that is down again")
        assert told(rx, while_down, "failed") == (0, 0)

        await rx.start()  # back, on the same port
        await rx.wait(lambda: told(rx, while_down, "failed") == (1, 1), "the late failure told")

        async def drained() -> bool:
            info = await consumer(nc)
            return info is not None and info.num_ack_pending == 0 and info.num_pending == 0

        await eventually(drained, 60, "every event to be told and acked", every=0.2)
        assert told(rx, failed, "failed") == (1, 1)
        assert told(rx, stalled, "stalled") == (1, 1)
        assert told(rx, stalled, "failed") == (1, 1)
        assert told(rx, diverged, "guarded") == (1, 1)
        assert told(rx, diverged, "failed") == (1, 1)
        assert told(rx, while_down, "failed") == (1, 1)
        assert rx.got("/json", lambda b: b["run_id"] == completes) == 0
        assert len([r for r in rx.requests if r.status < 300]) == 12, [
            (r.path, r.body.get("id")) for r in rx.requests
        ]
        alert = next(r.body for r in rx.requests if r.path == "/json")
        assert alert["pool"] == "default" and alert["event"]["type"] == "failed"
    finally:
        await stack.stop()  # which also audits every log: no permission refused
        await rx.stop()
