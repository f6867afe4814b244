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


def test_a_site_granted_by_time_has_room_in_expected_seconds() -> None:
    """A site's room by time: its trainers times the horizon, less what is left of the runs
    it trains (its heartbeat's step) and of those granted to it — by the job's measured
    speed where the pools bucket has one, else its `estimate_s`; by count otherwise."""
    timed = msgspec.structs.replace(SPEC, total_steps=100, estimate_s=50.0)
    r = Reckoner(config.load({"BATON_GRANT_AHEAD_S": "lab1=300"}))
    r.heard(trainer("t1", site="lab1", run_id="a.r1", step=60))
    r.heard(trainer("t2", site="lab2"))
    r.observe(record("a.r1", 1.0, spec=timed, site="lab1", state=RunState.RUNNING,
                     worker="t1", step=40), 1)  # fmt: skip
    r.observe(record("a.r2", 2.0, spec=timed, site="lab1"), 2)
    rooms = r.state("default", Pool(), {"lab1", "lab2"}).sites
    # 300 s, less 40 steps left of a.r1 (20 s) and all of a.r2 (50 s).
    lab1 = rooms["lab1"]
    assert lab1.time is not None and lab1.time.seconds == 230.0, lab1
    assert rooms["lab2"].time is None and rooms["lab2"].free == 2  # by count, one ahead
    # A measured speed of the job's name overrides its estimate: 0.1 s per step.
    r.speeds["default"]["n"] = 0.1
    lab1 = r.state("default", Pool(), {"lab1", "lab2"}).sites["lab1"]
    assert lab1.time is not None and lab1.time.seconds == 300.0 - 4.0 - 10.0, lab1
    # The pool's own horizon stands for a site the variable does not name.
    rooms = r.state("default", Pool(grant_ahead_s=60.0), {"lab1", "lab2"}).sites
    assert rooms["lab2"].time is not None and rooms["lab2"].time.seconds == 60.0
    assert r.by_time("default", Pool(), {"lab1"}) and not r.by_time("default", Pool(), {"lab2"})
    assert r.queued_jobs("default") == []
