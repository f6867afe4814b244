"""Job specs and helpers shared by the end-to-end tests."""

from __future__ import annotations

import uuid
from typing import Any

from nats.aio.client import Client

from baton.cli import client
from shared.contracts import JobSpec, RunRecord, convert
from shared.contracts.events import Event
from shared.runs import Runs
from tests.support.stack import eventually


def job(**over: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "e2e",
        "entry_point": "examples.regression:train",
        "total_steps": 120,
        "seed": 3,
        "deterministic": True,
        "checkpoint": {"every_steps": 20},
        "config": {"hidden": 32, "batch": 32},
        "idempotency_key": uuid.uuid4().hex,
    }
    base.update(over)
    return convert(base, JobSpec)


async def submit(nc: Client, spec: JobSpec) -> str:
    run_id, answer = await client.submit(nc, spec, 10)
    assert answer is not None and type(answer).__name__ == "Accepted", answer
    return run_id


async def finished(nc: Client, run_id: str, timeout: float = 90) -> RunRecord:
    runs = await Runs.open(nc.jetstream())

    async def terminal() -> RunRecord | None:
        found = await runs.get(run_id)
        return found[0] if found and found[0].state.terminal else None

    return await eventually(terminal, timeout, f"run {run_id} to finish", every=0.2)


async def history(nc: Client, run_id: str) -> list[Event]:
    from shared import names
    from shared.contracts import decode

    sub = await nc.jetstream().subscribe(names.events_of_run(run_id), ordered_consumer=True)
    out: list[Event] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                return out
            out.append(decode(msg.data, Event))  # type: ignore[arg-type]
    finally:
        await sub.unsubscribe()
