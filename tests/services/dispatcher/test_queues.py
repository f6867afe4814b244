"""What the scheduler knows of a pool, kept as records come and go: each owner's queue in
its order, the runs holding trainers, the trainers heard; and the queue it answers for."""

from __future__ import annotations

import msgspec

from services.dispatcher.queues import Reckoner, view_of
from shared import config
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.control import WorkerInfo
from shared.contracts.pools import Owner, Pool
from shared.contracts.records import Preemption
from shared.scheduling.model import Phase

SPEC = convert({"name": "n", "entry_point": "m:f", "total_steps": 10}, JobSpec)


def record(run_id: str, at: float, **fields: object) -> RunRecord:
    base = RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=at, updated_at=at,
        admitted=False,
    )  # fmt: skip
    return msgspec.structs.replace(base, **fields)


def trainer(name: str, **fields: object) -> WorkerInfo:
    base = WorkerInfo(worker=name, pool="default", host="h", pid=1, device="cpu", at=0.0)
    return msgspec.structs.replace(base, **fields)


def test_each_owners_queue_is_kept_in_order_as_records_come_and_go() -> None:
    r = Reckoner(config.load({}))
    r.observe(record("a.r1", 3.0), 1)
    r.observe(record("a.r2", 1.0), 2)
    r.observe(record("a.r3", 2.0, priority=5), 3)
    r.observe(record("b.r1", 0.5), 4)
    state = r.state("default", Pool(), set())
    assert [x.run_id for x in state.queued["a"]] == ["a.r3", "a.r2", "a.r1"], state.queued
    assert state.priorities == {0: 3, 5: 1} and state.runs == []
    # Admitted, then training: out of the queue, holding a trainer.
    r.observe(record("a.r3", 2.0, priority=5, admitted=True), 5)
    r.observe(record("a.r3", 2.0, priority=5, admitted=True, state=RunState.RUNNING,
                     worker="w1", token=1), 6)  # fmt: skip
    state = r.state("default", Pool(), set())
    assert [x.run_id for x in state.queued["a"]] == ["a.r2", "a.r1"]
    [held] = state.runs
    assert held.run_id == "a.r3" and held.phase is Phase.RUNNING and held.running_since
    # An older revision changes nothing; an ended run leaves; one asked to pause waits.
    assert not r.observe(record("a.r3", 2.0, priority=5), 3)
    r.observe(record("a.r3", 2.0, state=RunState.COMPLETED), 7)
    r.observe(record("a.r2", 1.0, pause_requested="wait"), 8)
    state = r.state("default", Pool(), set())
    assert state.runs == [] and [x.run_id for x in state.queued["a"]] == ["a.r1"]
    r.observe(record("a.r1", 3.0, state=RunState.CANCELLED), 9)
    assert "a" not in r.state("default", Pool(), set()).queued


def test_trainers_count_until_their_heartbeat_lapses_and_drained_ones_never() -> None:
    r = Reckoner(config.load({"BATON_HEARTBEAT": "0.001"}))
    r.heard(trainer("t1"))
    r.heard(trainer("t2", drained=True))
    r.heard(trainer("t3", site="lab1"))  # a site's trainer takes the hub's work too
    assert r.state("default", Pool(), set()).trainers == 2
    r.worker_ttl_s = 0.0
    assert r.state("default", Pool(), set()).trainers == 0


def test_a_leaving_run_is_shown_making_room_and_its_taker_as_preempting() -> None:
    r = Reckoner(config.load({}))
    r.heard(trainer("t1"))
    leaving = Preemption(by="b.r1", kind="priority", reason="priority 10 over 0")
    r.observe(record("a.r1", 1.0, admitted=True, state=RunState.RUNNING, worker="t1",
                     token=1, preempt=leaving), 1)  # fmt: skip
    r.observe(record("b.r1", 2.0, priority=10, admitted=True), 2)
    r.observe(record("c.r1", 3.0), 3)
    policy = Pool(owners={"c": Owner(weight=2)})
    view = view_of(r, "default", policy, 10)
    assert [w.run_id for w in view.waiting] == ["b.r1", "c.r1"], view.waiting
    assert view.waiting[0].waiting.startswith("preempting a.r1 (priority 10 over 0)")
    [going] = view.training
    assert going.run_id == "a.r1" and going.leaving.startswith("for b.r1"), going
    assert {o.owner for o in view.owners} == {"b", "c"} and view.more == 0
