"""Every way a run's record may move: named, pure record changes for `Runs.update`.

By the part of the record they move, each family a module of this package: an attempt's
start, hold and verdict (`attempts`); the run's life beside it — ended, cancelled, paused,
handed over, rolled back, its ending announced (`lifecycle`); sites and grants (`sites`);
sharing and credits: the scheduler and the ledger (`sharing`). Every one is named here too,
and the table below says who calls what.

A record changes only by compare-and-swap (`Runs.update`), through a `Change`: a function of
the newest record that returns the changed record, or None when the change no longer applies
(the run is over, someone newer holds it, someone else made the change first). Each function
here is one such change, or makes one from what its writer knows; none reads anything but
its arguments and the record, so a retried CAS applies it again to the newer record.

Two guards recur. *Not over*: a terminal record is never changed (apart from clearing its
announcement mark, and an operator's rollback reopening a FAILED run once its failure was
announced), so exactly one writer ends a run (`shared.state.endings`). *Still ours*:
an attempt's change applies only while the record names its token (to start or to wait: no
newer one), so a fenced attempt writes nothing.

    who            transitions
    dispatcher     cancel, pause, resume, order_rollback, add_hold (a resume's hold),
                   Taken (a hold taken, for resume and a reopening order_rollback),
                   ask_checkpoint (`baton checkpoint`)
    scheduler      admit, queued_because, ask_preempt, cap_ranks (in the dispatcher:
                   `shared.scheduling`)
    trainer        mark_running, advance_step, retoken, wait, note_waiting, complete,
                   cancel_attempt, pause_attempt, release, requeue, roll_back,
                   count_failure, lose_rank (a group that lost a rank), note_changed
                   (what a resume found changed), fail (entry point refused), pause_unowned,
                   cancel_unowned, requeue_unowned, unchanged, rewound and drop_rollback
                   (a rollback), yield_to and past_store (the store decides:
                   `shared.state.owner`)
    reaper         end, fail (deliveries used up), warn, redispatch, pause_unowned,
                   cancel_untrained (asked to cancel, nothing trains it), take_back and
                   reconcile (a site's grant), complete_from_store and
                   end_granted (a grant whose chain the hub finished, or sealed), settled
                   (the ledger), pause_unheld (an owner past the pool's overdraft)
    delegator      delegate (the scheduler granting queued runs to sites)
    site trainer   accept_grant, forward_requests, and the trainer's own, on the site's
                   records of the runs granted to it
    anyone         hand_over (a dead attempt's task), mark_ending and announced (endings)
"""

from __future__ import annotations

from shared.state.runs import Change
from shared.state.transitions.attempts import (
    Spent,
    advance_step,
    ask_checkpoint,
    book_time,
    cancel_attempt,
    cancel_unowned,
    complete,
    count_failure,
    lose_rank,
    mark_running,
    note_changed,
    note_waiting,
    pause_attempt,
    pause_unowned,
    release,
    requeue,
    requeue_unowned,
    retoken,
    roll_back,
    unchanged,
    wait,
)
from shared.state.transitions.lifecycle import (
    Taken,
    add_hold,
    announced,
    cancel,
    cancel_untrained,
    drop_rollback,
    end,
    fail,
    hand_over,
    mark_ending,
    order_rollback,
    pause,
    redispatch,
    resume,
    rewound,
    warn,
)
from shared.state.transitions.sharing import (
    admit,
    ask_preempt,
    cap_ranks,
    pause_unheld,
    queued_because,
    settled,
    unheld,
)
from shared.state.transitions.sites import (
    accept_grant,
    complete_from_store,
    delegate,
    end_granted,
    forward_requests,
    grantable,
    past_store,
    reconcile,
    take_back,
    yield_to,
)

__all__ = [
    "Change",
    "Spent",
    "Taken",
    "accept_grant",
    "add_hold",
    "admit",
    "advance_step",
    "announced",
    "ask_checkpoint",
    "ask_preempt",
    "book_time",
    "cancel",
    "cancel_attempt",
    "cancel_unowned",
    "cancel_untrained",
    "cap_ranks",
    "complete",
    "complete_from_store",
    "count_failure",
    "delegate",
    "drop_rollback",
    "end",
    "end_granted",
    "fail",
    "forward_requests",
    "grantable",
    "hand_over",
    "lose_rank",
    "mark_ending",
    "mark_running",
    "note_changed",
    "note_waiting",
    "order_rollback",
    "past_store",
    "pause",
    "pause_attempt",
    "pause_unheld",
    "pause_unowned",
    "queued_because",
    "reconcile",
    "redispatch",
    "release",
    "requeue",
    "requeue_unowned",
    "resume",
    "retoken",
    "rewound",
    "roll_back",
    "settled",
    "take_back",
    "unchanged",
    "unheld",
    "wait",
    "warn",
    "yield_to",
]
