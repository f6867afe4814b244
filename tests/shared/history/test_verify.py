"""The history checker on histories written out by hand: a clean one breaks nothing, and one
with a fault of each kind planted in it is caught, by the invariant that forbids it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts import events as ev
from shared.contracts.checkpoints import Manifest, Pointer, Rewound
from shared.contracts.ledger import Entry, Hold, Settle, TopUp
from shared.history import accounts, invariants
from shared.history.clocks import on_hub_clock
from shared.history.facts import (
    Checkpoints,
    History,
    LeaseHeld,
    Logged,
    Posted,
    Sighting,
    TopUpId,
    Violation,
)
from shared.history.verify import CHECKS, check, describe
from shared.ledger.book import subject_of
from shared.ledger.charges import charge, life_events
from shared.state.grants import site_epoch, token_of

A, B, C = "rA", "alice.rB", "rC"
SPEC = JobSpec(name="t", entry_point="examples.regression:train", total_steps=20)
replace = msgspec.structs.replace


def key(run_id: str, step: int, token: int) -> str:
    return f"runs/{run_id}/manifests/{step:012d}-{token:012d}.json"


def manifest(
    run_id: str, step: int, token: int, worker: str, previous: str | None, final: bool = False
) -> Manifest:
    return Manifest(
        run_id=run_id, token=token, step=step, worker=worker, files=[], final=final, metrics={},
        digest=f"digest-{run_id}-{step}" if final else "", previous=previous, created_at=0.0,
    )  # fmt: skip


def record(run_id: str, state: RunState, **over: object) -> RunRecord:
    r = RunRecord(run_id=run_id, spec=SPEC, spec_hash="x", created_at=0.0, updated_at=0.0)
    return replace(r, state=state, **over)


def logged(events: list[ev.Event]) -> list[Logged]:
    return [Logged(seq=i + 1, stamp=1000.0 + i, event=e) for i, e in enumerate(events)]


def posted(entries: list[Entry]) -> list[Posted]:
    return [Posted(seq=i + 1, subject=subject_of(e), entry=e) for i, e in enumerate(entries)]


def clean() -> History:
    """Run A trained by w1 to its end; run B (alice's, priced) failed, was reopened by a
    rollback and completed on w2, then settled."""
    events: list[ev.Event] = [
        ev.Accepted(run_id=A, name="t", pool="default", total_steps=20),
        ev.Started(run_id=A, worker="w1", token=5, attempt=1, start_step=0),
        ev.Progress(run_id=A, step=10, total_steps=20, worker="w1"),
        ev.CheckpointCommitted(run_id=A, step=10, token=5, manifest=key(A, 10, 5), bytes=1),
        ev.CheckpointCommitted(run_id=A, step=20, token=5, manifest=key(A, 20, 5), bytes=1),
        ev.Completed(run_id=A, step=20, digest=f"digest-{A}-20"),
        ev.Progress(run_id=A, step=20, total_steps=20, worker="w1"),  # its last words
        ev.Accepted(run_id=B, name="t", pool="default", total_steps=20),
        ev.Started(run_id=B, worker="w1", token=6, attempt=1, start_step=0),
        ev.CheckpointCommitted(run_id=B, step=10, token=6, manifest=key(B, 10, 6), bytes=1),
        ev.Failed(run_id=B, reason="user_code"),
        ev.RolledBack(run_id=B, token=8, from_step=10, to_step=10),
        ev.Started(run_id=B, worker="w2", token=8, attempt=2, start_step=10),
        ev.CheckpointCommitted(run_id=B, step=20, token=8, manifest=key(B, 20, 8), bytes=1),
        ev.Completed(run_id=B, step=20, digest=f"digest-{B}-20"),
    ]
    store_a = Checkpoints(
        run_id=A,
        latest=Pointer(run_id=A, token=5, step=20, manifest=key(A, 20, 5), final=True),
        manifests={
            key(A, 10, 5): manifest(A, 10, 5, "w1", None),
            key(A, 20, 5): manifest(A, 20, 5, "w1", key(A, 10, 5), final=True),
        },
    )
    rewound = Rewound(
        run_id=B, token=8, from_token=6, from_step=10, to_step=10, manifest=key(B, 10, 6),
        abandoned=[], created_at=0.0,
    )  # fmt: skip
    store_b = Checkpoints(
        run_id=B,
        latest=Pointer(run_id=B, token=8, step=20, manifest=key(B, 20, 8), final=True),
        manifests={
            key(B, 10, 6): manifest(B, 10, 6, "w1", None),
            key(B, 20, 8): manifest(B, 20, 8, "w2", key(B, 10, 6), final=True),
        },
        rewinds=[rewound],
    )
    ledger: list[Entry] = [
        TopUp(owner="alice", id="t1", amount=100),
        Hold(owner="alice", run_id=B, n=0, amount=10),
        Hold(owner="alice", run_id=B, n=1, amount=5),
        Settle(owner="alice", run_id=B, held=15, charged=7),
    ]
    priced = record(
        B, RunState.COMPLETED, digest=f"digest-{B}-20", price={"cpu": 1.0}, settled=True
    )
    return History(
        events=logged(events),
        records={B: priced},
        archived={A: record(A, RunState.COMPLETED, digest=f"digest-{A}-20")},
        checkpoints={A: store_a, B: store_b},
        ledger=posted(ledger),
        acknowledged_topups=[TopUpId(owner="alice", id="t1")],
        sightings=[Sighting(run_id=A, pid=123, alive_at=1005.0 + 10)],
    )


def test_a_clean_history_breaks_nothing() -> None:
    assert check(clean(), settled_exactly=True) == []
    leased = [LeaseHeld(key=A, worker="w1", token=5, revision=9)]  # renewed: its token named
    assert check(replace(clean(), leases=leased)) == []


def _events(h: History, fn: Callable[[list[ev.Event]], list[ev.Event]]) -> History:
    return replace(h, events=logged(fn([lg.event for lg in h.events])))


def _store(h: History, run_id: str, **over: object) -> History:
    return replace(h, checkpoints={**h.checkpoints, run_id: replace(h.checkpoints[run_id], **over)})


def _ledger(h: History, fn: Callable[[list[Posted]], list[Posted]]) -> History:
    return replace(h, ledger=fn(list(h.ledger)))


def _without(kind: type) -> Callable[[list[ev.Event]], list[ev.Event]]:
    return lambda es: [e for e in es if not isinstance(e, kind)]


def _dup_completed(es: list[ev.Event]) -> list[ev.Event]:
    done = next(e for e in es if isinstance(e, ev.Completed))
    return [*es, done]


def _late_settle(h: History) -> list[Posted]:
    late = Hold(owner="alice", run_id=B, n=2, amount=3)
    return [*h.ledger, Posted(seq=99, subject=subject_of(late), entry=late)]


def _second_settle(h: History) -> list[Posted]:
    again = Settle(owner="bob", run_id=B, held=15, charged=7)
    return [*h.ledger, Posted(seq=99, subject=subject_of(again), entry=again)]


def _misfiled(h: History) -> list[Posted]:
    top = TopUp(owner="alice", id="t2", amount=5)
    subject = names.ledger_subject("bob", "topup", "t2")
    return [*h.ledger, Posted(seq=99, subject=subject, entry=top)]


def _lost_queued_run(h: History) -> History:
    accepted = Logged(seq=99, stamp=2000.0, event=ev.Accepted(run_id=C, name="t", pool="p",
                                                               total_steps=1))  # fmt: skip
    return replace(h, events=[*h.events, accepted],
                   records={**h.records, C: record(C, RunState.QUEUED)})  # fmt: skip


def _stranger_after_end(es: list[ev.Event]) -> list[ev.Event]:
    return [*es, ev.Progress(run_id=A, step=20, total_steps=20, worker="w7")]


PLANTED: dict[str, tuple[str, Callable[[History], History]]] = {
    "an accepted run with no record": (
        invariants.RUN_KEPT, lambda h: replace(h, archived={})),
    "a queued run out of the live index": (invariants.RUN_KEPT, _lost_queued_run),
    "a failed run trains again without a rollback": (
        invariants.ENDS_STAY, lambda h: _events(h, _without(ev.RolledBack))),
    "another worker's progress after the end": (
        invariants.ENDS_STAY, lambda h: _events(h, _stranger_after_end)),
    "a reopened run failed again and no event says so": (
        invariants.END_TOLD,
        lambda h: _events(replace(h, records={B: replace(h.records[B], state=RunState.FAILED)}),
                          lambda es: es[:-1])),
    "two completed events": (
        invariants.COMPLETED_ONCE, lambda h: _events(h, _dup_completed)),
    "completed with no completed event": (
        invariants.COMPLETED_ONCE, lambda h: _events(h, _without(ev.Completed))),
    "a record's digest that is not the final checkpoint's": (
        invariants.COMPLETED_DIGEST,
        lambda h: replace(h, archived={A: replace(h.archived[A], digest="other")})),
    "completed while latest is not final": (
        invariants.COMPLETED_DIGEST,
        lambda h: _store(h, A, latest=replace(h.checkpoints[A].latest, final=False))),
    "a checkpoint after a final one": (
        invariants.FINAL_LAST,
        lambda h: _store(h, A, manifests={**h.checkpoints[A].manifests,
                                          key(A, 10, 5): manifest(A, 10, 5, "w1", None, True)})),
    "a token that went down along the chain": (
        invariants.TOKENS_GROW,
        lambda h: _store(h, A, manifests={**h.checkpoints[A].manifests,
                                          key(A, 10, 5): manifest(A, 30, 5, "w1", None)})),
    "two workers started under one token": (
        invariants.TOKEN_ONE_ATTEMPT,
        lambda h: _events(h, lambda es: [*es[:1], ev.Started(run_id=A, worker="w9", token=5,
                                                             attempt=2, start_step=0), *es[1:]])),
    "a manifest of another worker under a started token": (
        invariants.TOKEN_ONE_ATTEMPT,
        lambda h: _store(h, B, manifests={**h.checkpoints[B].manifests,
                                          key(B, 10, 6): manifest(B, 10, 6, "w5", None)})),
    "a lease held by another worker under a started token": (
        invariants.TOKEN_ONE_ATTEMPT,
        lambda h: replace(h, leases=[LeaseHeld(key=f"{A}.mac", worker="w8", token=0,
                                               revision=5)])),
    "a settlement giving back more than was held": (
        accounts.LEDGER_SUMS,
        lambda h: _ledger(h, lambda ps: [*ps[:3], replace(ps[3], entry=replace(ps[3].entry,
                                                                                held=20))])),
    "an entry under another owner's subject": (
        accounts.LEDGER_SUMS, lambda h: _ledger(h, lambda _: _misfiled(h))),
    "a run settled twice": (
        accounts.SETTLED_ONCE, lambda h: _ledger(h, lambda _: _second_settle(h))),
    "a record settled with no settlement": (
        accounts.SETTLED_ONCE, lambda h: _ledger(h, lambda ps: ps[:3])),
    "a hold after the settlement": (
        accounts.NOTHING_AFTER_SETTLE, lambda h: _ledger(h, lambda _: _late_settle(h))),
    "an acknowledged top-up lost": (
        accounts.TOPUPS_KEPT,
        lambda h: replace(h, acknowledged_topups=[*h.acknowledged_topups,
                                                  TopUpId(owner="alice", id="t9")])),
    "a run charged other than its events say": (
        accounts.CHARGED_RIGHT,
        lambda h: _ledger(h, lambda ps: [*ps[:3], replace(ps[3], entry=replace(ps[3].entry,
                                                          through=15, charged=10**9))])),
    "a training process alive long after the end": (
        accounts.PROCESS_ENDS,
        lambda h: replace(h, sightings=[Sighting(run_id=A, pid=321, alive_at=1005.0 + 90)])),
}  # fmt: skip


@pytest.mark.parametrize("planted", list(PLANTED), ids=list(PLANTED))
def test_each_planted_violation_is_caught_by_its_invariant(planted: str) -> None:
    invariant, plant = PLANTED[planted]
    found = check(plant(clean()))
    assert invariant in {v.invariant for v in found}, [describe(v) for v in found]
    assert all(v.detail for v in found), found


def test_every_invariant_has_a_planted_violation() -> None:
    assert {name for name, _ in CHECKS} == {inv for inv, _ in PLANTED.values()}


def test_settled_exactly_once_is_asked_for() -> None:
    unsettled = replace(
        clean(),
        records={B: replace(clean().records[B], settled=False)},
        ledger=clean().ledger[:3],
    )
    assert check(unsettled) == []
    found = check(unsettled, settled_exactly=True)
    assert [(v.invariant, v.runs) for v in found] == [(accounts.SETTLED_ONCE, [B])], found


def test_no_hold_is_left_once_the_reaper_had_its_chance() -> None:
    """A hold for a run that has no record (its submission's record never written) is left
    held: caught when every run is to be settled, not before."""
    h = clean()
    orphan = Posted(seq=9, subject="", entry=Hold(owner="alice", run_id="alice.rZ", amount=3, n=0))
    left = replace(h, ledger=[*h.ledger, replace(orphan, subject=subject_of(orphan.entry))])
    assert [v for v in check(left) if v.invariant == accounts.SETTLED_ONCE] == []
    found = check(left, settled_exactly=True)
    assert [(v.invariant, v.runs) for v in found] == [(accounts.SETTLED_ONCE, ["alice.rZ"])]


def test_a_rollback_after_the_end_lets_a_new_attempt_start() -> None:
    """The reopened run's attempt whose rollback was refused still counts as reopened."""
    refused = ev.RunWarning(run_id=B, kind="rollback_refused", detail="damaged")

    def swap(es: list[ev.Event]) -> list[ev.Event]:
        return [refused if isinstance(e, ev.RolledBack) else e for e in es]

    assert check(_events(clean(), swap)) == []


def test_a_replicated_run_is_kept_by_its_replicas() -> None:
    """A replicated job's own id is accepted and has no record: each replica is a run."""
    parent, replica = "rP", "rP-replica-0"
    accepted = [ev.Accepted(run_id=r, name="t", pool="p", total_steps=1) for r in (parent, replica)]
    h = clean()
    h = replace(
        h, events=[*h.events, *(Logged(seq=100 + i, stamp=2000.0, event=e)
                                for i, e in enumerate(accepted))], live=[replica],
        records={**h.records, replica: record(replica, RunState.RUNNING)},
    )  # fmt: skip
    assert check(h) == [], [describe(v) for v in check(h)]
    lost = replace(h, records=h.records | {replica: record(replica, RunState.RUNNING)}, live=[])
    assert [v.runs for v in check(lost)] == [[replica]], check(lost)


def test_a_violation_names_its_runs_and_entries() -> None:
    h = replace(clean(), archived={A: replace(clean().archived[A], digest="other")})
    (found,) = [v for v in check(h) if v.invariant == invariants.COMPLETED_DIGEST]
    assert found.runs == [A] and found.entries == [key(A, 20, 5)], found
    line = describe(found)
    assert line.startswith("[completed-digest] run rA") and key(A, 20, 5) in line, line
    assert msgspec.json.decode(msgspec.json.encode(found), type=Violation) == found


def test_a_history_round_trips_as_json() -> None:
    h = clean()
    assert msgspec.json.decode(msgspec.json.encode(h), type=History) == h


def test_docs_state_each_invariant_as_the_checker_does() -> None:
    """docs/verify.md's table is each check's docstring, word for word."""
    docs = (Path(__file__).resolve().parents[3] / "docs" / "verify.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in docs.splitlines()
            if line.startswith("| `")}  # fmt: skip
    for name, fn in CHECKS:
        stated = " ".join((fn.__doc__ or "").split())
        assert name in rows and stated and stated in rows[name], (name, stated)


def test_a_groups_members_last_words_after_the_end_are_no_violation() -> None:
    def grouped(es: list[ev.Event]) -> list[ev.Event]:
        formed = ev.GroupFormed(run_id=A, worker="w1", epoch=5, members=["w3"])
        late = ev.Progress(run_id=A, step=20, total_steps=20, worker="w3")
        return [*es[:2], formed, *es[2:7], late, *es[7:]]

    assert check(_events(clean(), grouped)) == []


def test_a_completion_still_being_announced_is_no_violation() -> None:
    h = clean()
    pending = replace(h.archived[A], announce_pending=True)
    told = _events(replace(h, archived={A: pending}), _without(ev.Completed))
    assert [v.runs for v in check(told)] == [[B]], check(told)  # B's completed is gone too


def test_late_words_of_a_taken_back_or_losing_attempt_are_no_violation() -> None:
    """A site's grant taken back (a lower token) and a side that lost to the store's chain
    (`superseded`) may still be heard after the end: their outboxes deliver late, and
    neither could go on training the run."""

    def late(es: list[ev.Event]) -> list[ev.Event]:
        taken_back = ev.Started(run_id=A, worker="site-w", token=3, attempt=1, start_step=0)
        lost = ev.Started(run_id=A, worker="dual-w", token=9, attempt=1, start_step=0)
        said = [
            ev.Progress(run_id=A, step=8, total_steps=20, worker="site-w"),
            ev.CheckpointCommitted(run_id=A, step=8, token=3, manifest=key(A, 8, 3), bytes=1),
            ev.Progress(run_id=A, step=4, total_steps=20, worker="dual-w"),
            ev.Superseded(run_id=A, owner="", epoch=0, loser="lab1", loser_token=9, wasted_steps=4),
        ]
        return [*es[:1], taken_back, *es[1:6], lost, *said, *es[6:]]

    assert check(_events(clean(), late)) == []
    # Without the `superseded` event, the later attempt's words are the run going on.
    going_on = _events(clean(), lambda es: _without(ev.Superseded)(late(es)))
    assert {v.invariant for v in check(going_on)} == {invariants.ENDS_STAY}, check(going_on)
    # So they are unless the hub handed that attempt over (its lease expired: a site's
    # trainer of a hub task, cut off, whose outbox delivers its words after the end).
    gave_up = ev.HandedOver(run_id=A, worker="dual-w", token=9, reason="its lease expired")
    handed = _events(clean(), lambda es: [*_without(ev.Superseded)(late(es)), gave_up])
    assert check(handed) == [], check(handed)


def test_late_words_of_an_earlier_attempt_of_a_side_that_lost_are_no_violation() -> None:
    """The same job at both sides of a cut, the hub having lost its unsynced tail: the hub's
    chain completes the run; the site's first attempt was fenced and its second yielded
    (`superseded` names the second's token). The first's words arrive after the end, under
    a token above every token the hub ever started, of the epoch that lost."""
    first, second = token_of(site_epoch("lab1"), 3), token_of(site_epoch("lab1"), 9)

    def dual(superseded: bool) -> History:
        lost = ev.Superseded(
            run_id=C, owner="", epoch=0, loser="lab1", loser_token=second, wasted_steps=0
        )
        es: list[ev.Event] = [
            ev.Accepted(run_id=C, name="t", pool="default", total_steps=20),
            ev.Completed(run_id=C, step=20, digest="d"),
            ev.Started(run_id=C, worker="site-w", token=first, attempt=1, start_step=8),
            ev.Progress(run_id=C, step=9, total_steps=20, worker="site-w"),
            ev.Fenced(run_id=C, worker="site-w", token=first, reason="orphan"),
            *([lost] if superseded else []),
        ]
        return _with_c(es, RunState.COMPLETED)

    assert _going_on(dual(True)) == [], [describe(v) for v in _going_on(dual(True))]
    # Without the `superseded` event, the site's first attempt is the run going on.
    assert len(_going_on(dual(False))) == 2, _going_on(dual(False))  # `started`, `progress`


def test_late_words_of_an_attempt_the_store_refused_are_no_violation() -> None:
    """CI, campaign seed 1: a site's trainer of a hub task, cut off, handed over, trains on
    and commits; the run is cancelled and its chain sealed; the hub forgets its tail (the
    `handed_over` among it) and ends the run again from the seal. The attempt's words come
    after, under a token above the last the hub's history started — and its own
    `commit_refused` says the store stopped it."""

    def forgot(refused: bool) -> History:
        said = ev.CommitRefused(run_id=C, step=60, token=73, reason="cancelled by the hub")
        es: list[ev.Event] = [
            ev.Accepted(run_id=C, name="t", pool="default", total_steps=70),
            ev.Started(run_id=C, worker="t2", token=62, attempt=2, start_step=30),
            ev.Cancelled(run_id=C, reason="cancelled: its checkpoint chain is sealed"),
            ev.Started(run_id=C, worker="site-w", token=73, attempt=4, start_step=20),
            ev.Progress(run_id=C, step=21, total_steps=70, worker="site-w"),
            ev.CheckpointCommitted(run_id=C, step=40, token=73, manifest=key(C, 40, 73), bytes=1),
            *([said] if refused else []),
        ]
        return _with_c(es, RunState.CANCELLED)

    assert _going_on(forgot(True)) == [], [describe(v) for v in _going_on(forgot(True))]
    # Without its `commit_refused`, nothing says the attempt could not go on.
    assert len(_going_on(forgot(False))) == 3, _going_on(forgot(False))


def _with_c(es: list[ev.Event], state: RunState) -> History:
    """`clean()`'s history with run C's events `es` after its own, C's record in `state`."""
    h = clean()
    return replace(
        h,
        events=logged([e.event for e in h.events] + es),
        records={**h.records, C: record(C, state)},
    )


def _going_on(h: History) -> list[Violation]:
    """`ends-stay`'s violations alone (run C's store is not these tests' matter)."""
    return [v for v in check(h) if v.invariant == invariants.ENDS_STAY]


def test_late_words_of_a_grant_taken_back_and_then_cancelled_are_no_violation() -> None:
    """A cancel asked of a granted run its site had not (as the hub knew) started: the hub
    takes the grant back, fencing its epoch, and cancels the run without starting it again.
    The site had started it during a cut: its words arrive after the `cancelled` event,
    under a token of the fenced epoch, above every token the hub ever started."""
    grant = token_of(3, 7)

    def cancelled(with_take_back: bool) -> History:
        taken = [ev.TakenBack(run_id=C, site="lab1", epoch=4, reason="asked to cancel")]
        es: list[ev.Event] = [
            ev.Accepted(run_id=C, name="t", pool="default", total_steps=20),
            ev.Delegated(run_id=C, site="lab1", epoch=3),
            *(taken if with_take_back else []),
            ev.Cancelled(run_id=C, reason="asked"),
            ev.Started(run_id=C, worker="site-w", token=grant, attempt=1, start_step=0),
            ev.Progress(run_id=C, step=8, total_steps=20, worker="site-w"),
        ]
        h = clean()
        return replace(
            h,
            events=logged([e.event for e in h.events] + es),
            records={**h.records, C: record(C, RunState.CANCELLED)},
        )

    assert check(cancelled(True)) == [], check(cancelled(True))
    # Without the take-back, the site's attempt is the run going on.
    going_on = check(cancelled(False))
    assert {v.invariant for v in going_on} == {invariants.ENDS_STAY}, going_on
    assert len(going_on) == 2, going_on  # its `started` and its `progress`


def test_a_settlement_charged_from_its_events_is_recomputed_to_the_unit() -> None:
    """What the reaper charged from the events up to `through` is what the checker finds
    again; the events after it (a site's late words) do not change it."""
    h = clean()
    upto = [lg for lg in h.events if lg.event.run_id == B]
    events = on_hub_clock([lg.event for lg in upto], [lg.stamp for lg in upto])
    due = charge(life_events(events, 0), {"cpu": 1.0})
    settle = replace(h.ledger[3].entry, through=upto[-1].seq, charged=due.charged)
    words = ev.Progress(run_id=B, step=20, total_steps=20, worker="w2")  # its last words
    late = Logged(seq=99, stamp=2000.0, event=words)
    kept = replace(h, ledger=[*h.ledger[:3], replace(h.ledger[3], entry=settle)],
                   events=[*h.events, late])  # fmt: skip
    assert check(kept) == [], [describe(v) for v in check(kept)]
