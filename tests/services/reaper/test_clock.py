"""The reaper's timeouts and retirements are timed on the hub server's clock, against a real
nats-server: records written by hosts an hour off are judged by how much time really passed.
The reaper runs as the `reaper` user of a server with `baton up`'s authorization: the
server-clock reads it makes are ones its role allows."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from services.reaper.service import Reaper
from shared import config
from shared.bus import names
from shared.bus.emit import emit
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import Accepted
from shared.state.clock import stamp
from shared.state.runs import Runs
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

HOUR = 3600.0


def spec(**limits: float) -> JobSpec:
    return convert({"name": "t", "entry_point": "m:f", "total_steps": 5, "limits": limits}, JobSpec)


def written_at(clock: float, s: JobSpec, run_id: str, **kw: object) -> RunRecord:
    """A record as a dispatcher whose clock reads `clock` writes it."""
    hard, soft = s.limits.hard_timeout_s, s.limits.soft_timeout_s
    return RunRecord(
        run_id=run_id, spec=s, spec_hash=spec_hash(s), created_at=clock, updated_at=clock,
        deadline_at=clock + hard if hard else None, soft_deadline_at=clock + soft if soft else None,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def accepted(nc: Client, runs: Runs, record: RunRecord) -> None:
    assert await runs.create(record)
    event = Accepted(run_id=record.run_id, name="t", pool="default", total_steps=5)
    await emit(nc.jetstream(), event, msg_id=f"accepted.{record.run_id}")


async def stamp_of(nc: Client, run_id: str, kind: str) -> float:
    msg = await nc.jetstream().get_msg(
        names.EVENTS_STREAM, subject=names.event_subject(run_id, kind)
    )
    return stamp(msg.time)


async def reaper(hub: AuthorizedHub, tmp_path: Path, **env: str) -> Reaper:
    settings = config.load({"BATON_LEASE_TTL": "60", "BATON_STORE": f"file://{tmp_path}", **env})
    r = Reaper(await hub.connect("reaper"), settings)
    await r.start()
    return r


async def test_timeouts_count_from_acceptance_on_the_servers_clock(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    nc = await authorized.connect("operator")
    runs = await Runs.open(nc.jetstream())
    # A dispatcher an hour behind: by its times the deadlines passed long ago. They did not.
    behind = written_at(time.time() - HOUR, spec(soft_timeout_s=300, hard_timeout_s=600), "rbehind")
    await accepted(nc, runs, behind)
    # A dispatcher an hour ahead, 1 s hard timeout: by its times it has an hour left. It has 1 s.
    ahead = written_at(time.time() + HOUR, spec(hard_timeout_s=1), "rahead")
    await accepted(nc, runs, ahead)
    r = await reaper(authorized, tmp_path)
    try:

        async def failed() -> RunRecord | None:
            await r.sweep()
            found = await runs.get("rahead")
            return found[0] if found and found[0].state.terminal else None

        ended = await eventually(failed, 30, "the 1 s hard timeout", every=0.2)
        assert ended.state is RunState.FAILED and ended.reason
        assert ended.reason.startswith("hard_timeout"), ended.reason
        took = await stamp_of(nc, "rahead", "failed") - await stamp_of(nc, "rahead", "accepted")
        assert took >= 1.0, f"failed {took:.3f}s after it was accepted, on the server's clock"

        found = await runs.get("rbehind")
        assert found is not None and found[0].state is RunState.QUEUED and not found[0].warned
        with pytest.raises(NotFoundError):  # no soft-timeout warning either
            await stamp_of(nc, "rbehind", "warning")
    finally:
        await r.close()


async def test_a_run_without_its_accepted_event_falls_back_to_its_created_at(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    """Only when the event is not (or no longer) stored: the dispatcher's clock against the
    reaper's, two hub services."""
    runs = await Runs.open((await authorized.connect("operator")).jetstream())
    assert await runs.create(written_at(time.time() - HOUR, spec(hard_timeout_s=600), "rold"))
    r = await reaper(authorized, tmp_path)
    try:
        await r.sweep()
        found = await runs.get("rold")
        assert found is not None and found[0].state is RunState.FAILED
    finally:
        await r.close()


async def test_an_ended_run_retires_by_the_servers_stamp_of_its_last_write(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    nc = await authorized.connect("operator")
    runs = await Runs.open(nc.jetstream())
    done = {"state": RunState.COMPLETED, "step": 5, "digest": "d"}
    # Ended by trainers an hour behind and an hour ahead: `updated_at` is theirs.
    assert await runs.create(written_at(time.time() - HOUR, spec(), "rbehind", **done))
    assert await runs.create(written_at(time.time() + HOUR, spec(), "rahead", **done))
    patient = await reaper(authorized, tmp_path, BATON_GC_AGE="3600")
    try:
        await patient.sweep()
        assert sorted(await runs.live_ids()) == ["rahead", "rbehind"], "over for an hour? no"
    finally:
        await patient.close()
    r = await reaper(authorized, tmp_path, BATON_GC_AGE="1")
    try:

        async def retired() -> bool:
            await r.sweep()
            return await runs.live_ids() == []

        await eventually(retired, 30, "both to retire a second after their last write")
    finally:
        await r.close()
