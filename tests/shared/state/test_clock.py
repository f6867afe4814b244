"""The hub's clock: server timestamps read exactly, the server's time now, and the stamps of
records and heartbeats — against a real nats-server, whatever this process's clock says."""

from __future__ import annotations

import datetime
import time

import pytest
from nats.aio.client import Client

from shared.bus import names
from shared.contracts import JobSpec, RunRecord, convert, encode, spec_hash
from shared.contracts.control import WorkerInfo
from shared.state.clock import age, parse, server_now, stamp
from shared.state.runs import Runs
from shared.state.workers import heard_workers

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
DAY = 86400.0


def test_server_timestamps_parse_to_the_microsecond() -> None:
    assert parse("1970-01-01T00:00:01Z") == 1.0
    assert parse("2026-11-26T00:42:22.580608859Z") == pytest.approx(1795653742.580608, abs=1e-6)
    assert parse("2026-11-26T00:42:22.5Z") == pytest.approx(1795653742.5, abs=1e-6)
    assert parse("2026-11-26T01:42:22.5+01:00") == parse("2026-11-26T00:42:22.5Z")
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=datetime.UTC)
    assert stamp(when) == when.timestamp()
    with pytest.raises(ValueError):
        stamp(None)
    assert age(10.0, 4.0) == 6.0
    assert age(10.0, 12.0) == 0.0, "never negative"


async def test_the_servers_now_and_its_stamps_are_one_clock(declared: Client) -> None:
    js = declared.jetstream()
    runs = await Runs.open(js)
    # Written by a host whose clock is a day behind: its `updated_at` says so, the server's
    # stamp does not.
    skewed = time.time() - DAY
    record = RunRecord(
        run_id="rskew", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=skewed, updated_at=skewed
    )
    before = await server_now(declared, f"KV_{names.RUNS_BUCKET}")
    assert await runs.create(record)
    found = await runs.stamped("rskew")
    after = await server_now(declared, f"KV_{names.RUNS_BUCKET}")
    assert found is not None and found.record == record
    assert before <= found.written <= after
    assert found.written - found.record.updated_at > DAY / 2
    assert (found.record, found.revision) == await runs.get("rskew")
    assert await runs.stamped("rnone") is None
    [(run_id, live)] = await runs.live_stamped()
    assert run_id == "rskew" and live is not None and live.revision == found.revision

    # A heartbeat: its `at` is its trainer's clock, its stamp the hub's.
    info = WorkerInfo(worker="w1", pool="p", host="h", pid=1, device="cpu", at=skewed)
    await js.publish(f"$KV.{names.WORKERS_BUCKET}.w1", encode(info))
    [heard] = await heard_workers(js)
    now = await server_now(declared, f"KV_{names.WORKERS_BUCKET}")
    assert heard.info == info and 0 <= age(now, heard.at) < 60

    with pytest.raises(RuntimeError):
        await server_now(declared, "NO_SUCH_STREAM")
