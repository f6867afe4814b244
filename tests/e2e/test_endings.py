"""A run's ending survives its writer dying between the record and the event."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from shared import faults
from shared.contracts import RunState
from shared.contracts.events import Completed
from shared.state.runs import Runs
from tests.e2e.jobs import history, job, submit
from tests.support.stack import Stack, alive, eventually

REPO = Path(__file__).resolve().parents[2]


async def test_a_writer_killed_between_the_ending_and_its_event(tmp_path: Path) -> None:
    s = Stack(tmp_path / "stack", trainers=0, lease_ttl=3)
    try:
        await s.start(("dispatcher", "checkpointer", "reaper"))
        pid = await s.add_trainer("doomed", env={faults.ENV: "after-ending-written"})
        nc = await s.client()
        run_id = await submit(nc, job(total_steps=30, config={"hidden": 16, "batch": 16}))

        async def died() -> bool:
            return not alive(pid)

        await eventually(died, 90, "the trainer to die at the fault point")
        runs = await Runs.open(nc.jetstream())
        found = await runs.get(run_id)
        assert found is not None and found[0].state is RunState.COMPLETED

        # `baton watch` returns on the terminal record, event or not.
        auth = s.root / "auth" / "operator.env"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "baton", "watch", run_id, cwd=REPO,
            env={**os.environ, "NATS_URL": s.nats.url, "NATS_AUTH_FILE": str(auth)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, (out, err)

        # The reaper finds the ending unannounced and publishes its event.
        async def announced() -> bool:
            found = await runs.get(run_id)
            return found is not None and not found[0].announce_pending

        await eventually(announced, 30, "the reaper to announce the ending")
        completed = [e for e in await history(nc, run_id) if isinstance(e, Completed)]
        assert len(completed) == 1
        assert completed[0].digest == found[0].digest and completed[0].step == 30
        assert f"{run_id}: completed without its event" in s.log("reaper")
    finally:
        await s.stop()
