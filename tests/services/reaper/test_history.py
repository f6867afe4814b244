"""Ended runs leave the live control plane: the sweep reads the live index, never the
history, and an archived run still answers. The reaper's code runs as the `reaper` user of
a server with `baton up`'s authorization, so its retirement needs nothing its role lacks."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import msgspec

from baton.client import calls as client
from baton.stack.natsserver import NatsServer
from services.reaper.service import Reaper
from shared import config
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState, convert, encode, spec_hash
from shared.state import archive
from shared.state.lease import Lease
from shared.state.runs import Runs
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
HISTORY = 10_000


def record(run_id: str, state: RunState = RunState.QUEUED, **kw: object) -> RunRecord:
    now = time.time()
    return RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=state, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def sent_by(server: NatsServer, connection: str) -> int:
    """Messages (requests and publishes) the server received from the named connection."""

    def read() -> int:
        url = f"http://127.0.0.1:{server.http_port}/connz?limit=1000"
        with urllib.request.urlopen(url, timeout=5) as resp:
            conns = json.load(resp)["connections"]
        return int(next(c["in_msgs"] for c in conns if c.get("name") == connection))

    return await asyncio.to_thread(read)


async def history_of(js: object, count: int) -> None:
    """`count` ended runs as the reaper leaves them once retired: in the archive, and still
    in the runs bucket (their retention not over), but not in the live index."""
    from nats.js import JetStreamContext

    assert isinstance(js, JetStreamContext)
    # Batches small enough, and an acknowledgement wait long enough, that a loaded machine
    # writing them to a file store answers every one: this is set-up, not what is measured.
    batch = 100
    for start in range(0, count, batch):
        writes = []
        for i in range(start, min(count, start + batch)):
            r = record(f"rold{i:05d}", RunState.COMPLETED, step=5)
            kv = f"$KV.{names.RUNS_BUCKET}.{r.run_id}"
            writes.append(js.publish(kv, encode(r), timeout=60))
            writes.append(js.publish(names.archive_subject(r.run_id), encode(r), timeout=60))
        await asyncio.gather(*writes)


async def test_a_sweep_with_ten_thousand_ended_runs_makes_no_more_requests(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    monitored = authorized.server
    setup = await authorized.connect("operator", "setup")
    reaper_nc = await authorized.connect("reaper", "reaper-under-test")
    try:
        js = setup.jetstream()
        runs = await Runs.open(js)
        # Live work of each kind the sweep looks at: a queued run, a running one with its
        # lease held, and a run that ended but whose terminal event is not stored yet.
        assert await runs.create(record("rqueued"))
        assert await runs.create(record("rrunning", RunState.RUNNING, token=1, worker="w"))
        assert await Lease(js, "rrunning", "w", ttl_s=60).acquire()
        pending = record("rpending", RunState.FAILED, reason="x", announce_pending=True)
        assert await runs.create(pending)
        settings = config.load({"BATON_LEASE_TTL": "60", "BATON_STORE": f"file://{tmp_path}"})
        reaper = Reaper(reaper_nc, settings)
        await reaper.start()
        # What is counted is the sweep's requests alone: the watchers `start` opens are
        # stopped (an ordered consumer recreates itself when a loaded machine delays its
        # heartbeat, a request of its own in the middle of a sweep's count).
        await reaper.lapses.stop()
        await reaper.sites.stop()
        await reaper.sweep()  # the first sweep also lists the store for garbage

        async def cost_of_a_sweep() -> int:
            before = await sent_by(monitored, "reaper-under-test")
            assert await reaper.sweep() == []
            return await sent_by(monitored, "reaper-under-test") - before

        without_history = await cost_of_a_sweep()
        await history_of(js, HISTORY)
        info = await js.stream_info(f"KV_{names.RUNS_BUCKET}")
        assert info.state.messages == HISTORY + 3
        with_history = await cost_of_a_sweep()
        assert without_history > 0
        assert with_history == without_history
        assert sorted(await runs.live_ids()) == ["rpending", "rqueued", "rrunning"]
    finally:
        await reaper_nc.close()
        await setup.close()


async def test_an_ended_run_is_archived_and_still_answers_once_the_bucket_forgot_it(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    nc = await authorized.connect("operator", "test")
    as_reaper = await authorized.connect("reaper", "reaper-under-test")
    try:
        js = nc.jetstream()
        runs = await Runs.open(js)
        assert await runs.create(record("rdone"))
        assert await runs.create(record("rlate"))
        end = {"state": RunState.COMPLETED, "step": 5, "digest": "d" * 64}
        await runs.update("rdone", lambda r: msgspec.structs.replace(r, **end))  # type: ignore[arg-type]
        await runs.update(
            "rlate",
            lambda r: msgspec.structs.replace(r, **end, announce_pending=True),  # type: ignore[arg-type]
        )
        env = {
            "BATON_RETAIN_ENDED": "1",
            "BATON_LEASE_TTL": "60",
            "BATON_STORE": f"file://{tmp_path}",
        }
        # Not before it has been over for BATON_GC_AGE: a zombie's upload may still land.
        patient = Reaper(as_reaper, config.load(env))
        await patient.start()
        await patient.sweep()
        await patient.close()
        assert sorted(await runs.live_ids()) == ["rdone", "rlate"]
        reaper = Reaper(as_reaper, config.load({**env, "BATON_GC_AGE": "1"}))
        await reaper.start()

        async def retired() -> bool:
            await reaper.sweep()
            return await runs.live_ids() == ["rlate"]

        # Retired: archived, out of the live index; one whose event is not stored stays.
        await eventually(retired, 10, "the ended run to be retired")
        await reaper.close()
        archived = await archive.find(js, "rdone")
        assert archived is not None and archived.digest == "d" * 64
        await eventually(
            lambda: _gone(runs, "rdone"), 10, "the runs bucket to forget the retired run"
        )
        # Still answers: the CLI's read, `baton status` itself, and the listing of history.
        assert (await client.record(nc, "rdone")).state is RunState.COMPLETED
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "baton", "status", "rdone", "-s", authorized.url, "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "NATS_AUTH_FILE": str(authorized.vault.root / "operator.env")},
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)["state"] == "COMPLETED"
        assert [r.run_id for r in await client.all_records(nc)] == ["rlate"]
        assert {r.run_id for r in await client.all_records(nc, history=True)} == {"rdone", "rlate"}
        # A run id names one run for ever: the same key submitted again is a duplicate.
        assert not await runs.create(record("rdone"))
        assert await runs.get("rdone") is None
        assert "rdone" not in await runs.live_ids()

        # Nothing of a retired run stays in the live index, not even a delete marker: what
        # listing the index reads follows the live runs.
        async def only_the_live_left() -> bool:
            info = await js.stream_info(f"KV_{names.LIVE_BUCKET}")
            return info.state.messages == 1

        await eventually(only_the_live_left, 10, "the retired run's delete marker to expire")
    finally:
        await nc.close()


async def _gone(runs: Runs, run_id: str) -> bool:
    return await runs.get(run_id) is None
