"""What the CLI shows of a run of several ranks: its group (workers by rank and its epoch)
or why it is not training yet, and the group's events as lines of `watch` and `logs`."""

from __future__ import annotations

import time

import msgspec

from baton.cli.status import _group_rows
from baton.cli.watch import describe
from shared.contracts import JobSpec, RankRange, RunRecord, RunState
from shared.contracts.events import (
    AttemptFailed,
    GroupFormed,
    Preempted,
    RankLost,
    Resized,
    Restored,
)

SPEC = JobSpec(name="g", entry_point="m:f", total_steps=10, ranks=2)


def record(**fields: object) -> RunRecord:
    now = time.time()
    return RunRecord(
        run_id="r1", spec=SPEC, spec_hash="h", created_at=now, updated_at=now, **fields
    )  # type: ignore[arg-type]


def test_status_shows_the_group_or_why_it_waits() -> None:
    why = "forming a group of 2: 1 of 2 ranks held, waiting for 1 more trainer(s)"
    assert _group_rows(record(waiting=why)) == [("ranks", "2"), ("waiting", why)]
    running = record(state=RunState.RUNNING, token=41, group=["t1", "t3"], worker="t1")
    assert _group_rows(running) == [("ranks", "2"), ("group", "epoch 41; 0: t1, 1: t3")]
    one = JobSpec(name="g", entry_point="m:f", total_steps=10)
    assert _group_rows(msgspec.structs.replace(running, spec=one)) == []


def test_watch_names_the_group_the_lost_rank_and_the_failed_rank() -> None:
    formed = GroupFormed(run_id="r1", worker="t1", epoch=7, members=["t1", "t2"])
    assert describe(formed) == "group of 2 formed, epoch 7 (0: t1, 1: t2)"
    lost = RankLost(run_id="r1", worker="t1", epoch=7, rank=1, lost="t2", reason="silent", step=30)
    line = describe(lost)
    assert line is not None and "rank 1 lost" in line and "t2" in line and "step 30" in line
    failed = AttemptFailed(
        run_id="r1", worker="t1", attempt=1, reason="rank 1's code failed", rank=1
    )
    line = describe(failed)
    assert line is not None and "rank 1" in line


def test_an_elastic_run_shows_its_range_its_size_now_and_each_resize() -> None:
    spec = JobSpec(name="g", entry_point="m:f", total_steps=10, ranks=RankRange(min=1, max=3))
    running = record(state=RunState.RUNNING, token=9, group=["t1", "t2"], group_size=2)
    rows = _group_rows(msgspec.structs.replace(running, spec=spec))
    assert rows[0] == ("ranks", "1 to 3 (elastic; 2 now)")
    resized = Resized(
        run_id="r1", worker="t1", epoch=9, from_ranks=1, to_ranks=2, step=40,
        reason="1 more trainer(s) of pool 'default' free",
    )  # fmt: skip
    line = describe(resized)
    assert line is not None and "from 1 to 2 ranks at step 40" in line and "free" in line
    rows = _group_rows(msgspec.structs.replace(running, spec=spec), [resized])
    assert rows[1] == ("resized", f"1 time(s); last 1 → 2 at step 40: {resized.reason}")
    grow = Preempted(run_id="r1", worker="t1", step=40, reason="to grow its group onto t2")
    line = describe(grow)
    assert line is not None and "after step 40" in line and "to grow its group onto t2" in line


def test_watch_says_a_sharded_run_resumed_at_another_size() -> None:
    """An FSDP2 run's resize (docs/sharded.md): what it read, and that it is not exact."""
    restored = Restored(run_id="r1", worker="t1", step=20, resharded_from=3, read_bytes=3 << 20)
    line = describe(restored)
    assert line is not None and "step 20" in line and "3 ranks" in line and "3.0 MiB" in line
    assert "not the old size's bits" in line
    assert describe(Restored(run_id="r1", worker="t1", step=20)) is None  # a plain resume
