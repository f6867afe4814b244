"""What must hold of every run's history: its record, its events and its checkpoints. Each
invariant is one pure function of a `History`, stated in its docstring exactly as it is
checked, and named by a stable short id (docs/verify.md lists them).

Invariant: a check reads nothing but the `History` it is given, and says every breach it
finds as a `Violation` naming the runs and entries that show it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

from shared.contracts import events as ev
from shared.contracts.records import RunState, replica_of
from shared.history.facts import History, Logged, Violation
from shared.state.grants import epoch_of, token_of

RUN_KEPT = "run-kept"
ENDS_STAY = "ends-stay"
END_TOLD = "end-told"
COMPLETED_ONCE = "completed-once"
COMPLETED_DIGEST = "completed-digest"
FINAL_LAST = "final-last"
TOKENS_GROW = "tokens-grow"
TOKEN_ONE_ATTEMPT = "token-one-attempt"

ENDINGS = (ev.Completed, ev.Failed, ev.Cancelled)
REOPENED_BY = "rollback_refused"
"""The warning a reopened run's attempt gives when the rollback it was reopened for was
refused: the run goes on reopened, from where it was."""


def by_run(history: History) -> dict[str, list[Logged]]:
    """The events of each run, in stream order."""
    found: dict[str, list[Logged]] = defaultdict(list)
    for logged in history.events:
        found[logged.event.run_id].append(logged)
    return found


def run_kept(history: History) -> list[Violation]:
    """1. A run accepted is never lost: every run with an `accepted` event has a record, in
    the runs bucket or the archive (a replicated run: its replicas have, each accepted and
    checked as a run of its own); one found in the archive alone is terminal; and one whose
    record is not terminal is live (in `baton_live`, what the control plane sweeps)."""
    out = []
    live = set(history.live)
    replicated = {found[0] for r in history.run_ids() if (found := replica_of(r)) is not None}
    for run_id, logged in by_run(history).items():
        accepted = [lg for lg in logged if isinstance(lg.event, ev.Accepted)]
        if not accepted:
            continue
        seq = f"event {accepted[0].seq}"
        record = history.record(run_id)
        if record is None and run_id in replicated:
            continue
        if record is None:
            why = f"run {run_id} was accepted but has no record, live or archived"
        elif run_id not in history.records and not record.state.terminal:
            why = f"run {run_id}'s archived record is {record.state.value}, not an end"
        elif not record.state.terminal and run_id not in live:
            why = f"run {run_id} is {record.state.value} but not in the live index"
        else:
            continue
        out.append(Violation(invariant=RUN_KEPT, detail=why, runs=[run_id], entries=[seq]))
    return out


def ends_stay(history: History) -> list[Violation]:
    """2a. A run leaves a terminal state only when an operator reopens it, and its events say
    so: after a `completed`, `failed` or `cancelled` event, no other such event appears, and
    nothing of an attempt that could go on training it — a `started`, `progress`, `restored`
    or `checkpoint_committed` — but the last words of attempts that could not: the one
    training when it ended (its trainer's or its group's members', under its token), one
    under a lower token, one of an epoch a `taken_back` event fenced (a site's grant taken
    back — also one the hub then ended without starting it again, as a cancel asked before
    it heard the site start it — whose outbox delivers late), one of a side's epoch a
    `superseded` event says lost to the other side (any attempt of that side under that
    epoch: the store's chain is the other's), one a `handed_over` event says the
    hub gave up on (its lease expired: a site's trainer of a hub task, cut off, trains on in
    vain and its outbox delivers late — the store refuses its commits once the run ended),
    or one whose own `commit_refused` says the store refused it (fenced, or the run's chain
    sealed or final: the word that stands when a hub that forgot its tail lost the
    `handed_over`) — until a `rolled_back` event (or the reopened attempt's
    `rollback_refused` warning) says the run was reopened. A second `completed` is
    `completed-once`'s to say."""
    out = []
    for run_id, logged in by_run(history).items():
        lost = {lg.event.token for lg in logged if isinstance(lg.event, ev.HandedOver)}
        lost |= {lg.event.token for lg in logged if isinstance(lg.event, ev.CommitRefused)}
        beaten = {
            epoch_of(lg.event.loser_token) for lg in logged if isinstance(lg.event, ev.Superseded)
        }
        fenced = max(
            (token_of(lg.event.epoch, 0) for lg in logged if isinstance(lg.event, ev.TakenBack)),
            default=0,
        )
        ended: Logged | None = None
        workers, token = frozenset[str](), -1  # the attempt training when the run ended
        last_workers, last_token = frozenset[str](), -1
        started: dict[str, int] = {}  # each worker's newest `started` token so far
        for lg in logged:
            e = lg.event
            if isinstance(e, ev.Started):
                started[e.worker] = e.token
            if ended is None:
                if isinstance(e, ev.Started):
                    last_workers, last_token = frozenset([e.worker]), e.token
                elif isinstance(e, ev.GroupFormed) and e.epoch == last_token:
                    last_workers |= {e.worker, *e.members}
                elif isinstance(e, ENDINGS):
                    ended, workers, token = lg, last_workers, last_token
                continue
            if _reopens(e):
                ended = None
                continue
            completed = isinstance(ended.event, ev.Completed)
            if _goes_on(e, Ended(workers, token, lost, beaten, fenced, started, completed)):
                out.append(_went_on(run_id, ended, lg))
    return out


def _went_on(run_id: str, ended: Logged, lg: Logged) -> Violation:
    return Violation(
        invariant=ENDS_STAY,
        detail=f"run {run_id} ended ({ev.kind_of(ended.event)}, event {ended.seq}) and then "
        f"{ev.kind_of(lg.event)} (event {lg.seq}) with no rollback reopening it",
        runs=[run_id],
        entries=[f"event {ended.seq}", f"event {lg.seq}"],
    )


def end_told(history: History) -> list[Violation]:
    """2b. A FAILED or CANCELLED run's end is told: once its record is no longer
    `announce_pending`, its events after the last that reopened it (`rolled_back`, or the
    reopened attempt's `rollback_refused` warning) hold its `failed` or `cancelled` event. (A
    COMPLETED run's is `completed-once`'s to say.)"""
    out = []
    events = by_run(history)
    for run_id in history.run_ids():
        record = history.record(run_id)
        if record is None or record.announce_pending:
            continue
        kind = {RunState.FAILED: ev.Failed, RunState.CANCELLED: ev.Cancelled}.get(record.state)
        if kind is None:
            continue
        told = False
        for lg in events.get(run_id, []):
            if _reopens(lg.event):
                told = False
            elif isinstance(lg.event, kind):
                told = True
        if not told:
            out.append(
                Violation(
                    invariant=END_TOLD,
                    detail=f"run {run_id} is {record.state.value} and no "
                    f"`{record.state.value.lower()}` event tells it (since it was last reopened)",
                    runs=[run_id],
                )
            )
    return out


def _reopens(e: ev.Event) -> bool:
    return isinstance(e, ev.Reopened | ev.RolledBack) or (
        isinstance(e, ev.RunWarning) and e.kind == REOPENED_BY
    )


@dataclass(frozen=True)
class Ended:
    """What `ends_stay` knows of a run that ended, for the events after its end."""

    workers: frozenset[str]
    """The attempt training when it ended: its trainer, and its group's members."""
    token: int
    """That attempt's token."""
    lost: set[int]
    """Tokens of attempts a `handed_over` event says the hub gave up on, or whose commit
    the store refused (`commit_refused`)."""
    beaten: set[int]
    """Epochs a `superseded` event says lost to the other side: every attempt of the losing
    side under that epoch trained in vain (the store's chain is the other side's)."""
    fenced: int
    """Every token below this is of an epoch a `taken_back` event fenced (0: none)."""
    started: dict[str, int]
    """Each worker's newest `started` token so far."""
    completed: bool
    """It ended COMPLETED (a second `completed` is `completed-once`'s to say)."""

    def silenced(self, token: int | None) -> bool:
        """An attempt under `token` could not go on training the run: the ending one's,
        one below it, one of a fenced epoch, one the hub gave up on or the store refused,
        or one of an epoch that lost to the other side."""
        return token is not None and (
            token <= self.token
            or token < self.fenced
            or token in self.lost
            or epoch_of(token) in self.beaten
        )


def _goes_on(e: ev.Event, end: Ended) -> bool:
    """Whether `e`, after the run's end, is the run going on (not the last words of an
    attempt that could not go on: `Ended.silenced`)."""
    if isinstance(e, ENDINGS):
        return not (end.completed and isinstance(e, ev.Completed))
    if isinstance(e, ev.Started):
        return not end.silenced(e.token)
    if isinstance(e, (ev.Progress, ev.Restored)):
        return e.worker not in end.workers and not end.silenced(end.started.get(e.worker))
    if isinstance(e, ev.CheckpointCommitted):
        return not end.silenced(e.token)
    return False


def completed_once(history: History) -> list[Violation]:
    """3a. A COMPLETED run has exactly one `completed` event in the hub's history (once its
    record is no longer `announce_pending`: not before it is published); a run with a
    `completed` event is COMPLETED (the record is written first, `shared.state.endings`)."""
    out = []
    events = by_run(history)
    for run_id in history.run_ids():
        record = history.record(run_id)
        done = [lg for lg in events.get(run_id, []) if isinstance(lg.event, ev.Completed)]
        seqs = [f"event {lg.seq}" for lg in done]
        completed = record is not None and record.state is RunState.COMPLETED
        pending = record is not None and record.announce_pending and not done
        if completed and not pending and len(done) != 1:
            why = f"run {run_id} is COMPLETED with {len(done)} `completed` events"
        elif done and (record is None or record.state is not RunState.COMPLETED):
            state = record.state.value if record is not None else "without a record"
            why = f"run {run_id} has a `completed` event but is {state}"
        else:
            continue
        out.append(Violation(invariant=COMPLETED_ONCE, detail=why, runs=[run_id], entries=seqs))
    return out


def completed_digest(history: History) -> list[Violation]:
    """3b. A COMPLETED run's record carries the digest of the store's final checkpoint: its
    `latest` names a manifest that is final and whose digest is the record's — the
    checkpoint `baton pull` returns."""
    out = []
    for run_id in history.run_ids():
        record = history.record(run_id)
        if record is None or record.state is not RunState.COMPLETED:
            continue
        store = history.checkpoints.get(run_id)
        latest = store.latest if store is not None else None
        key = latest.checkpoint if latest is not None else None
        manifest = store.manifests.get(key) if store is not None and key else None
        if manifest is None:
            why = f"run {run_id} is COMPLETED but `latest` names no stored manifest"
        elif not manifest.final or not (latest is not None and latest.final):
            why = f"run {run_id} is COMPLETED but `latest` names a checkpoint that is not final"
        elif manifest.digest != record.digest:
            why = (
                f"run {run_id}'s record has digest {record.digest!r}, its final checkpoint "
                f"{manifest.digest!r}"
            )
        else:
            continue
        keys = [key] if key else []
        out.append(Violation(invariant=COMPLETED_DIGEST, detail=why, runs=[run_id], entries=keys))
    return out


def final_last(history: History) -> list[Violation]:
    """4a. Along a run's chain (`latest`, then each manifest's `previous`) no manifest
    follows a final one: a final checkpoint is the newest of the chain, unless a rollback's
    note names it as where `latest` was rewound to."""
    out = []
    for run_id, store in history.checkpoints.items():
        rewound_to = {note.manifest for note in store.rewinds}
        chain = store.chain()
        for newer, older in itertools.pairwise(chain):
            if store.manifests[older].final and older not in rewound_to:
                out.append(
                    Violation(
                        invariant=FINAL_LAST,
                        detail=f"run {run_id}: checkpoint {newer} follows the final {older}",
                        runs=[run_id],
                        entries=[older, newer],
                    )
                )
    return out


def tokens_grow(history: History) -> list[Violation]:
    """4b. Tokens never decrease along a run's chain: each manifest's (token, step) is above
    its `previous`'s — a higher token, or the same token and a higher step."""
    out = []
    for run_id, store in history.checkpoints.items():
        chain = store.chain()
        for newer, older in itertools.pairwise(chain):
            n, o = store.manifests[newer], store.manifests[older]
            if (n.token, n.step) <= (o.token, o.step):
                out.append(
                    Violation(
                        invariant=TOKENS_GROW,
                        detail=f"run {run_id}: checkpoint {newer} (token {n.token}, step "
                        f"{n.step}) follows {older} (token {o.token}, step {o.step})",
                        runs=[run_id],
                        entries=[older, newer],
                    )
                )
    return out


def token_one_attempt(history: History) -> list[Violation]:
    """4c. No two attempts of a run used one token: the workers its `started` events name,
    those its stored manifests name and the one its lease names (the lease's token, else its
    revision's under the record's epoch) are one per token (a group's members count as its
    leader, by the `group_formed` event of that token)."""
    out = []
    events = by_run(history)
    for run_id in sorted(set(events) | set(history.checkpoints)):
        leader: dict[tuple[int, str], str] = {}
        used: dict[int, dict[str, str]] = defaultdict(dict)  # token -> worker -> where seen
        for lg in events.get(run_id, []):
            e = lg.event
            if isinstance(e, ev.GroupFormed):
                leader.update({(e.epoch, m): e.worker for m in e.members})
            elif isinstance(e, ev.Started):
                used[e.token].setdefault(e.worker, f"event {lg.seq}")
        store = history.checkpoints.get(run_id)
        for key, m in store.manifests.items() if store is not None else ():
            used[m.token].setdefault(leader.get((m.token, m.worker), m.worker), key)
        record = history.record(run_id)
        for lease in history.leases:
            if run_id in (lease.key, lease.key.rpartition(".")[0]):
                epoch = record.epoch if record is not None else 0
                token = lease.token or token_of(epoch, lease.revision)
                used[token].setdefault(lease.worker, f"lease {lease.key}")
        for token, workers in sorted(used.items()):
            if len(workers) > 1:
                out.append(
                    Violation(
                        invariant=TOKEN_ONE_ATTEMPT,
                        detail=f"run {run_id}: token {token} was used by "
                        f"{', '.join(sorted(workers))}",
                        runs=[run_id],
                        entries=[workers[w] for w in sorted(workers)],
                    )
                )
    return out
