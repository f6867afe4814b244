"""The lost-run and unqueued sweeps against a real nats-server, with two reapers racing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from services.reaper.service import Reaper
from shared import config
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState, convert, encode, spec_hash
from shared.state.lease import Lease
from shared.state.runs import Runs
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)


async def running(nc: Client, run_id: str) -> Runs:
    return await created(nc, run_id, state=RunState.RUNNING, token=1, worker="gone")


async def created(nc: Client, run_id: str, **fields: Any) -> Runs:
    runs = await Runs.open(nc.jetstream())
    now = time.time()
    record = RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        **fields,
    )  # fmt: skip
    assert await runs.create(record)
    return runs


async def queued_tasks(nc: Client, run_id: str) -> int:
    info = await nc.jetstream().stream_info(
        names.TASKS_STREAM, subjects_filter=names.task_subject("default", run_id)
    )
    return sum((info.state.subjects or {}).values())


async def racing_reapers(
    authorized: AuthorizedHub, tmp_path: Path
) -> Callable[[], Awaitable[list[str]]]:
    """Two started reapers, each as the `reaper` user of `baton up`'s authorization on its
    own connection; the call returned sweeps with both at once: the runs they dispatched."""
    settings = config.load({"BATON_LEASE_TTL": "2", "BATON_STORE": f"file://{tmp_path}"})
    a = Reaper(await authorized.connect("reaper", "reaper-a"), settings)
    b = Reaper(await authorized.connect("reaper", "reaper-b"), settings)
    await a.start()
    await b.start()

    async def swept() -> list[str]:
        done = await asyncio.gather(a.sweep(), b.sweep())
        return done[0] + done[1]

    return swept


async def test_two_racing_reapers_dispatch_a_lost_run_once(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    nc = await authorized.connect("operator")
    runs = await running(nc, "rlost")
    swept = await racing_reapers(authorized, tmp_path)
    assert await swept() == []  # first sighting: not yet lost
    redispatched = await eventually(swept, 10, "the run to count as lost", every=0.3)
    assert redispatched == ["rlost"]
    assert await queued_tasks(nc, "rlost") == 1
    found = await runs.get("rlost")
    assert found is not None and found[0].dispatch == 2
    assert await swept() == []  # a task is queued now: nothing more to do


async def test_an_admitted_run_whose_task_was_never_queued_is_queued_once(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    # The scheduler admitted both, then died before publishing the task; a run it has not
    # admitted has no task by design, and is left to it.
    nc = await authorized.connect("operator")
    runs = await created(nc, "radmitted", state=RunState.QUEUED, admitted=True)
    await created(nc, "rwaiting", state=RunState.QUEUED, admitted=False)
    swept = await racing_reapers(authorized, tmp_path)
    assert await swept() == []  # first sighting: its admitter may still be publishing
    queued = await eventually(swept, 10, "the admitted run's task to be queued", every=0.3)
    assert set(queued) == {"radmitted"}
    assert await queued_tasks(nc, "radmitted") == 1  # both may publish: one task, one id
    assert await queued_tasks(nc, "rwaiting") == 0
    found = await runs.get("radmitted")
    assert found is not None and found[0].dispatch == 1 and found[0].state is RunState.QUEUED
    assert await swept() == []  # its task is queued now: nothing more to do


async def test_a_held_lease_or_a_queued_task_is_left_alone(
    declared: Client, tmp_path: Path
) -> None:
    nc = declared
    await running(nc, "rheld")
    await running(nc, "rqueued")
    js = nc.jetstream()
    lease = Lease(js, "rheld", "w", ttl_s=30)
    assert await lease.acquire()
    await js.publish(names.task_subject("default", "rqueued"), encode({"queued": True}))
    reaper = Reaper(nc, config.load({"BATON_LEASE_TTL": "2", "BATON_STORE": f"file://{tmp_path}"}))
    await reaper.start()
    deadline = time.monotonic() + 3  # longer than the TTL the sweep waits for
    while time.monotonic() < deadline:
        assert await reaper.sweep() == []
        await asyncio.sleep(0.3)
