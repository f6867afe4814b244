"""What must hold of the credits ledger, and of the training processes a run leaves behind.
Each invariant is one pure function of a `History`, stated in its docstring exactly as it
is checked (docs/verify.md).

Invariant: the ledger's checks read the entries as stored — each under its subject — and
fold them with the ledger's own code (`shared.ledger.book.Account`), so what they find wrong
is wrong in what `baton credits` and the dispatcher's balance checks read.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from shared.bus import names
from shared.contracts import events as ev
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.history.clocks import on_hub_clock
from shared.history.facts import History, Posted, Violation
from shared.ledger.book import Account, subject_of
from shared.ledger.charges import charge, life_events, whole

LEDGER_SUMS = "ledger-sums"
SETTLED_ONCE = "settled-once"
NOTHING_AFTER_SETTLE = "nothing-after-settle"
TOPUPS_KEPT = "topups-kept"
CHARGED_RIGHT = "charged-right"
PROCESS_ENDS = "process-ends"

GRACE_S = 30.0
"""How long a training process may outlive its run's end (a trainer learns of an end it did
not write within a third of a lease's TTL, then kills the process)."""


def ledger_sums(history: History) -> list[Violation]:
    """5a. Each owner's balance is the sum of its entries: every entry is stored under the
    subject that names it (`book.subject_of`: its owner, kind and identity — what makes it
    written once), and the balance the ledger's fold gives each owner is the sum of its
    entries' deltas; a settlement gives back what the ledger held for its run's life before
    it (`held` is the sum of the holds of the run's life stored ahead of it)."""
    out = []
    accounts: dict[str, Account] = {}
    sums: Counter[str] = Counter()
    held: Counter[tuple[str, int]] = Counter()
    for p in history.ledger:
        e = p.entry
        if p.subject != subject_of(e):
            out.append(_entry(f"entry stored under {p.subject} names {subject_of(e)}", p))
        accounts.setdefault(e.owner, Account(e.owner)).fold(p.seq, e)
        sums[e.owner] += e.delta
        if isinstance(e, Hold):
            held[e.run_id, e.life] += e.amount
        elif isinstance(e, Settle) and e.held != held[e.run_id, e.life]:
            why = (
                f"run {e.run_id} settled {e.held} units held (life {e.life}), the ledger "
                f"held {held[e.run_id, e.life]}"
            )
            out.append(_entry(why, p, e.run_id))
    for owner, account in sorted(accounts.items()):
        if account.balance != sums[owner]:
            out.append(
                Violation(
                    invariant=LEDGER_SUMS,
                    detail=f"owner {owner!r}: balance {account.balance}, entries sum to "
                    f"{sums[owner]}",
                    entries=[names.ledger_of(owner)],
                )
            )
    return out


def _entry(why: str, p: Posted, run_id: str = "") -> Violation:
    return Violation(
        invariant=LEDGER_SUMS, detail=why, runs=[run_id] if run_id else [], entries=[p.subject]
    )


def settled_once(history: History, exactly: bool = False) -> list[Violation]:
    """5b. Each life of an ended run is settled at most once: one `settle` entry at most per
    run and life (a run reopened by a rollback after its settlement begins a new life), and
    a record marked `settled` has one for its life. With `exactly` (`baton verify
    --settled`: once the reaper has had its chance), every ended run with a price and an
    owner has exactly one for its life, and no hold is left: every life held for is
    settled but the live one of a run not ended."""
    out = []
    settles: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    held: dict[tuple[str, int], str] = {}
    for p in history.ledger:
        if isinstance(p.entry, Settle):
            settles[p.entry.run_id][p.entry.life].append(p.subject)
        elif isinstance(p.entry, Hold):
            held.setdefault((p.entry.run_id, p.entry.life), p.subject)
    if exactly:
        out += _holds_left(history, held, settles)
    for run_id in sorted(set(settles) | set(history.run_ids())):
        lives = settles.get(run_id, {})
        record = history.record(run_id)
        life = record.life if record is not None else 0
        found = lives.get(life, [])
        billable = record is not None and record.state.terminal and bool(record.price)
        billable = billable and record is not None and bool(record.owner)
        twice = {n: subjects for n, subjects in lives.items() if len(subjects) > 1}
        if twice:
            n, subjects = min(twice.items())
            why = f"run {run_id} is settled {len(subjects)} times (life {n})"
            found = subjects
        elif not found and record is not None and record.settled:
            why = f"run {run_id}'s record says settled but the ledger has no settlement"
        elif not found and exactly and billable:
            why = f"run {run_id} ended with a price and is not settled"
        else:
            continue
        out.append(Violation(invariant=SETTLED_ONCE, detail=why, runs=[run_id], entries=found))
    return out


def _holds_left(
    history: History, held: dict[tuple[str, int], str], settles: dict[str, dict[int, list[str]]]
) -> list[Violation]:
    out = []
    for (run_id, life), subject in sorted(held.items()):
        record = history.record(run_id)
        if settles.get(run_id, {}).get(life) or (record is not None and record.life == life):
            continue  # settled, or its run's own life: said above when it ended unsettled
        why = f"run {run_id} still holds credits for its life {life}, which is not settled"
        out.append(Violation(invariant=SETTLED_ONCE, detail=why, runs=[run_id], entries=[subject]))
    return out


def nothing_after_settle(history: History) -> list[Violation]:
    """5c. Nothing is written for a run's life after its settlement: no entry naming the
    run and that life is stored after (in the stream's order) the life's `settle` entry."""
    out = []
    settled: dict[tuple[str, int], Posted] = {}
    for p in history.ledger:
        e = p.entry
        if isinstance(e, TopUp):
            continue
        if (e.run_id, e.life) in settled:
            first = settled[e.run_id, e.life]
            out.append(
                Violation(
                    invariant=NOTHING_AFTER_SETTLE,
                    detail=f"run {e.run_id}: {p.subject} was written after its settlement",
                    runs=[e.run_id],
                    entries=[first.subject, p.subject],
                )
            )
        elif isinstance(e, Settle):
            settled[e.run_id, e.life] = p
    return out


def topups_kept(history: History) -> list[Violation]:
    """5d. No acknowledged top-up is lost: each top-up's identity (owner, id) is stored
    once, and every top-up a writer was told was stored (`History.acknowledged_topups`) is
    in the ledger."""
    out = []
    stored = Counter(
        (p.entry.owner, p.entry.id) for p in history.ledger if isinstance(p.entry, TopUp)
    )
    for (owner, topup), n in sorted(stored.items()):
        if n > 1:
            out.append(_topup(f"top-up {topup!r} of {owner!r} is stored {n} times", owner, topup))
    for ack in history.acknowledged_topups:
        if (ack.owner, ack.id) not in stored:
            why = f"top-up {ack.id!r} of {ack.owner!r} was acknowledged and is not in the ledger"
            out.append(_topup(why, ack.owner, ack.id))
    return out


def _topup(why: str, owner: str, topup: str) -> Violation:
    subject = names.ledger_subject(owner, "topup", topup)
    return Violation(invariant=TOPUPS_KEPT, detail=why, entries=[subject])


def charged_right(history: History) -> list[Violation]:
    """5e. Each run is charged exactly what its events say: a settlement that names the
    last event it was charged from (`through`) charges, to the unit, the productive and
    own-failure trainer-seconds of its life's events up to that one, at the price its
    record was accepted at (`shared.ledger.charges`) — as any reader recomputes them from
    the stored events on the hub's clock."""
    out = []
    logged: dict[str, list[tuple[ev.Event, float, int]]] = defaultdict(list)
    for lg in history.events:
        logged[lg.event.run_id].append((lg.event, lg.stamp, lg.seq))
    for p in history.ledger:
        e = p.entry
        record = history.record(e.run_id) if isinstance(e, Settle) else None
        if not isinstance(e, Settle) or not e.through or record is None:
            continue
        upto = [(x, at) for x, at, seq in logged.get(e.run_id, []) if seq <= e.through]
        events = on_hub_clock([x for x, _ in upto], [at for _, at in upto])
        if not whole(events, e.life):
            continue  # its events are gone: what any reader has is a part of them
        due = charge(life_events(events, e.life), record.price)
        if due.charged != e.charged:
            why = (
                f"run {e.run_id} (life {e.life}) was charged {e.charged} units; its events "
                f"through {e.through} say {due.charged} ({due.productive_s:.3f} productive "
                f"and {due.failed_s:.3f} failed trainer-seconds)"
            )
            out.append(Violation(invariant=CHARGED_RIGHT, detail=why, runs=[e.run_id],
                                 entries=[p.subject]))  # fmt: skip
    return out


def process_ends(history: History, grace_s: float = GRACE_S) -> list[Violation]:
    """6. No training process of a run outlives its terminal state by more than a grace:
    no process of the run is seen alive (`History.sightings`) more than `grace_s` (30 s by
    default) after the hub stored the run's terminal event — the last one, when a rollback
    reopened it — unless a `started` event, a newer attempt, was stored after that end."""
    ends: dict[str, float] = {}
    for lg in history.events:
        e = lg.event
        if isinstance(e, (ev.Completed, ev.Failed, ev.Cancelled)):
            ends[e.run_id] = lg.stamp
        elif isinstance(e, ev.Started):
            ends.pop(e.run_id, None)
    out = []
    for seen in history.sightings:
        end = ends.get(seen.run_id)
        if end is not None and seen.alive_at - end > grace_s:
            out.append(
                Violation(
                    invariant=PROCESS_ENDS,
                    detail=f"run {seen.run_id}: process {seen.pid} alive "
                    f"{seen.alive_at - end:.1f} s after the run ended (grace {grace_s:g} s)",
                    runs=[seen.run_id],
                    entries=[f"pid {seen.pid}"],
                )
            )
    return out
