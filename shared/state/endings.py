"""How a run ends: one path for every terminal outcome, whoever decides it.

A run ends when a compare-and-swap moves its record to COMPLETED, FAILED or CANCELLED; every
change refuses a terminal record, so exactly one writer ends a run. The trainer, the
dispatcher, the reaper and the dead-letter path all end runs through `settle`:

    1. the record change, retried through outages (the record is the truth: once the run is
       over nothing may lose that), and stamped `announce_pending` with the site whose
       outbox will carry the event
    2. the terminal event, derived from the terminal record alone (`terminal_event`) and
       published under the run's one id for it, `<kind>.<run>` (`names.ending_id`)
    3. `announce_pending` cleared

A writer that dies between 1 and 2 leaves a terminal record still pending: the reaper finds it
(`repair`), looks the event up in the events stream, publishes it if it is not there, under
the same id, and clears the mark; so the event appears once. Readers never wait on the event
alone: `baton watch` and `status` end on a terminal record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import Error as JetStreamError
from nats.js.errors import NotFoundError

from shared import faults
from shared.backoff import Backoff, retrying
from shared.bus import names
from shared.bus.emit import emit
from shared.contracts import RunRecord, RunState
from shared.contracts.events import Cancelled, Completed, Failed, kind_of
from shared.state import transitions
from shared.state.runs import Change, Runs

log = logging.getLogger("baton.endings")

Ending = Completed | Failed | Cancelled

OUTAGES = (TimeoutError, NatsTimeoutError, NoRespondersError, JetStreamError)
"""What a record write raises while the hub is out of reach; anything else is a bug."""


def terminal_event(record: RunRecord, detail: str = "") -> Ending:
    """The event that says how `record`'s run ended, from the record alone, so that anyone
    who finds the event missing can publish the same one. `detail` (a log tail) is the
    writer's extra; a repaired event goes without it."""
    reason = record.reason or record.state.value.lower()
    match record.state:
        case RunState.COMPLETED:
            return Completed(
                run_id=record.run_id, step=record.step, digest=record.digest or "",
                metrics=record.metrics,
            )  # fmt: skip
        case RunState.FAILED:
            return Failed(run_id=record.run_id, reason=reason, detail=detail)
        case RunState.CANCELLED:
            return Cancelled(run_id=record.run_id, reason=reason)
    raise ValueError(f"{record.run_id} is {record.state.value}, not over")


async def settle(
    js: JetStreamContext,
    runs: Runs,
    run_id: str,
    change: Change,
    *,
    site: str = "",
    detail: str = "",
    give_up: Callable[[], bool] = lambda: False,
) -> RunRecord | None:
    """Apply `change` to the run's record, retrying through outages until it holds, is
    refused (None: the run is no longer the caller's to change), or `give_up()` says to
    stop trying (None too). If the change ended the run, announce it. `site`: where the
    caller publishes (a site's outbox, or the hub for "")."""
    record = await retrying(
        lambda: runs.update(run_id, transitions.mark_ending(change, site)),
        retry_on=OUTAGES,
        what=f"{run_id}: writing the run record failed",
        backoff=Backoff(first=0.5, most=5.0),
        give_up=give_up,
        log=log,
    )
    if record is not None and record.announce_pending:
        faults.hit("after-ending-written")
        await announce(js, runs, record, site=site, detail=detail)
    return record


async def announce(
    js: JetStreamContext, runs: Runs, record: RunRecord, *, site: str = "", detail: str = ""
) -> None:
    """Publish the terminal event of `record` (retried until stored: at a site, into the
    site's outbox), then clear the record's mark. The mark is best effort: left set, the
    reaper finds the event stored and only clears it."""
    event = terminal_event(record, detail)
    await emit(js, event, msg_id=names.ending_id(kind_of(event), record.run_id), site=site)
    try:
        await runs.update(record.run_id, transitions.announced)
    except OUTAGES as exc:
        log.info("%s: announced; clearing the mark failed (%s)", record.run_id, exc)


async def repair(js: JetStreamContext, runs: Runs, record: RunRecord) -> bool:
    """For a terminal record still marked pending, long after it was written (the reaper
    waits): publish its terminal event unless the events stream already holds it, then
    clear the mark. Returns whether the event had to be published."""
    kind = kind_of(terminal_event(record))
    subject = names.event_subject(record.run_id, kind)
    try:
        await js.get_last_msg(names.EVENTS_STREAM, subject)
        stored = True
    except NotFoundError:
        stored = False
    if not stored:
        log.warning("%s: %s without its event; publishing it", record.run_id, kind)
        await emit(js, terminal_event(record), msg_id=names.ending_id(kind, record.run_id))
    await runs.update(record.run_id, transitions.announced)
    return not stored
