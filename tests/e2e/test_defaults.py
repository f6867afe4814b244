"""The stack as `baton up` deploys it — its committed authorization, each service its own
role — runs a job to its end and keeps sweeping after it: the run is retired into the
archive and its goodput exported, and no server refuses anything any service asks."""

from __future__ import annotations

import re
from pathlib import Path

from shared import auth
from shared.bus import names
from shared.state import archive
from shared.state.runs import Runs
from tests.e2e.jobs import finished, job, submit
from tests.support.stack import Stack, eventually

SWEPT = re.compile(r"baton\.reaper: swept \d+ live run")
REPO = Path(__file__).resolve().parents[2]


def committed_hub_config() -> str:
    """deploy/nats/auth-hub.conf without its header: what every deployment runs."""
    text = (REPO / "deploy" / "nats" / "auth-hub.conf").read_text()
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("#")).strip()


async def test_a_finished_run_is_retired_and_accounted_under_the_default_roles(
    tmp_path: Path,
) -> None:
    # The permissions the stack's servers enforce are the committed ones (which
    # tests/deploy checks are `baton auth-config` output): one source, two consumers.
    assert committed_hub_config() == auth.deployment_config(None, ("site1",)).strip()
    s = Stack(
        tmp_path / "stack",
        trainers=1,
        env={"BATON_GC_AGE": "1", "BATON_SWEEP_INTERVAL": "0.5"},
    )
    await s.start()
    try:
        nc = await s.client()
        js = nc.jetstream()
        run_id = await submit(nc, job(total_steps=40))
        record = await finished(nc, run_id)
        assert record.state.value == "COMPLETED", record
        sweeps_at_end = len(SWEPT.findall(s.log("reaper")))

        async def retired() -> bool:
            return await archive.find(js, run_id) is not None

        await eventually(retired, 60, "the ended run to be retired into the archive")
        runs = await Runs.open(js)
        assert run_id not in await runs.live_ids(), "a retired run leaves the live index"
        found = await archive.find(js, run_id)
        assert found is not None and found.state.value == "COMPLETED", found

        async def accounted() -> bool:
            return f"{run_id}: goodput" in s.log("reaper")

        await eventually(accounted, 30, "the run's goodput to be exported")

        async def two_more_sweeps() -> bool:
            return len(SWEPT.findall(s.log("reaper"))) >= sweeps_at_end + 2

        await eventually(two_more_sweeps, 30, "two sweeps after the run ended")
        assert "sweep failed" not in s.log("reaper"), s.log("reaper")[-3000:]
        # The stop below reads every log again (tests/support/audit.py); say it here too,
        # where a reader of this test looks for it.
        assert s.audit.findings() == [], s.audit.findings()
        assert names.ARCHIVE_STREAM in {i.config.name for i in await js.streams_info()}
    finally:
        await s.stop()
