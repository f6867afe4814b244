"""Run records read back: `Runs.confirmed` asks the bucket's leader before it calls a record
missing (a direct get may come from a replica still catching up)."""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client

from shared.bus import names
from shared.contracts import JobSpec, RunRecord, spec_hash
from shared.state.runs import Runs


async def test_a_record_is_missing_only_when_the_leader_says_so(
    declared: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = declared.jetstream()
    runs = await Runs.open(js)
    spec = JobSpec(name="r", entry_point="m:f", total_steps=3)
    now = time.time()
    record = RunRecord(
        run_id="rconf", spec=spec, spec_hash=spec_hash(spec), created_at=now, updated_at=now
    )
    assert await runs.create(record)
    found = await runs.confirmed("rconf")
    assert found is not None and found[0] == record
    assert await runs.confirmed("rnever") is None

    async def stale(run_id: str) -> None:  # what a replica still catching up answers
        return None

    with monkeypatch.context() as m:
        m.setattr(runs, "get", stale)
        found = await runs.confirmed("rconf")
        assert found is not None and found[0] == record, "the leader's copy was not asked"
    await (await js.key_value(names.RUNS_BUCKET)).delete("rconf")
    assert await runs.confirmed("rconf") is None  # a delete marker is no record
