"""Keeping an attempt's claim alive, and listening to what the run record says.

Every third of the lease TTL (and at once after a reconnect or a `wake` command) the
keeper touches the task message (`in_progress`), renews the lease, and reads the run
record — the truth about the run — for orders: cancel it, pause it, roll it back, write a
checkpoint an operator asked for, or the run is already over (a hard timeout). A renewal
that loses its CAS means the lease lapsed or was taken: the keeper re-takes a lapsed lease
only if nobody else moved the run on meanwhile; otherwise the attempt is fenced.

For a run granted to this trainer's site (`granted.py`), the lease and the record are the
site's own, and after each renewal the keeper also asks the hub, while it can, whether the
grant still holds: a run the hub took back is fenced.

Once the attempt's verdict is decided (`settling`), the lease decides nothing more: the
verdict's record write is a compare-and-swap on the token the attempt ran under, which
succeeds exactly when nobody moved the run on. So the keeper then only renews: a renewal
that loses its CAS ends the keeping, and never re-takes — a re-take would move the
record's token under the verdict being written and refuse the attempt's own ending (a run
that finished during a long cut took a second attempt after heal that way).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from shared import telemetry
from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.contracts import RunRecord
from shared.contracts.child import Control
from shared.contracts.records import Preemption
from shared.logs import Condition
from shared.state import transitions
from shared.state.lease import Lease
from shared.state.runs import Runs
from shared.waits import still_wanted, wait_set

log = logging.getLogger("baton.trainer")

RETRY_S = 0.5


class Order(enum.IntEnum):
    """What the run record (or the lease) tells an attempt, weakest first: a stronger order
    replaces a weaker one, never the reverse."""

    PREEMPT = 0
    """The scheduler makes room for another run (`RunRecord.preempt`): checkpoint, then
    stop; the run is queued again, or its elastic group re-forms smaller. The weakest: any
    other order asked too is carried out instead (a pause still checkpoints first)."""
    ROLLBACK = 1
    """The run is rolled back (`rollback_to`): stop at once without a checkpoint and give
    the task back; the next attempt rewinds (`rewind.py`). Weaker than all but a
    preemption, so a cancel or a pause asked too is carried out (the rollback waits in the
    record)."""
    PAUSE = 2
    """The run is asked to pause: checkpoint, then stop; the run waits for a human."""
    CANCEL = 3
    """The run is asked to cancel: checkpoint, then stop."""
    STALL = 4
    """The training process made no progress for too long (`stall.py`): it counts as
    failed."""
    OVER = 5
    """The run ended elsewhere (a hard timeout): stop."""
    FENCE = 6
    """Someone else holds the run: stop at once and touch nothing of it."""


class Orders:
    """The strongest order given so far; `changed` is set whenever it gets stronger."""

    def __init__(self) -> None:
        self.given: Order | None = None
        self.reason = ""
        self.changed = asyncio.Event()
        self.preemption: Preemption | None = None
        """What the scheduler asked, with `Order.PREEMPT`: for whom, why, whole or smaller."""

    def give(self, order: Order, reason: str) -> None:
        if self.given is None or order > self.given:
            self.given, self.reason = order, reason
            self.changed.set()

    def preempt(self, preemption: Preemption) -> None:
        if self.given is None:
            self.preemption = preemption
        self.give(Order.PREEMPT, f"to make room for {preemption.by}: {preemption.reason}")

    def fence(self, reason: str) -> None:
        self.give(Order.FENCE, reason)

    @property
    def fenced(self) -> bool:
        return self.given is Order.FENCE


class Keeper:
    def __init__(
        self,
        run_id: str,
        lease: Lease,
        runs: Runs,
        store: Store,
        beat_now: asyncio.Event,
        send: Callable[[Control], None],
        *,
        may_retake: bool = True,
        grant: Callable[[], Awaitable[str | None]] | None = None,
        on_record: Callable[[RunRecord], None] | None = None,
    ) -> None:
        self.run_id = run_id
        self.lease = lease
        self.runs = runs
        self.store = store
        self.beat_now = beat_now
        self.send = send
        self.orders = Orders()
        self.may_retake = may_retake
        """False for a group's leader: its ranks carry the epoch they started with."""
        self.settled = False
        """The attempt's verdict is decided: renew only (see the module's docstring)."""
        self.grant = grant
        """For a run granted to this trainer's site: why the hub no longer grants it, or
        None (`granted.py`); asked after each renewal, and a reason fences the attempt."""
        self.renewal = Condition(log, f"{run_id}: lease renewal", "training goes on")
        """Logs a run of failed renewals (a cut link) once as it starts and once as it ends."""
        self.on_record = on_record
        """Told the record at every renewal (an elastic group reads its cap there)."""
        self.checkpoints_served = 0
        """The record's `checkpoints_asked` this attempt has had written (those asked
        before it started are the attempt's to ignore: it set this from its record)."""

    def settling(self) -> None:
        """The attempt's verdict is decided and about to be written: from now on a lost
        renewal ends the keeping, never re-takes the lease nor fences the attempt."""
        self.settled = True

    async def keep(self, touch: Callable[[], Awaitable[None]]) -> None:
        interval = self.lease.ttl_s / 3
        wait = interval
        while not self.orders.fenced:
            still_wanted()  # a renewal's request may have swallowed its cancellation
            await wait_set(self.beat_now, wait)
            self.beat_now.clear()
            try:
                await touch()
                if not await self.lease.renew():
                    telemetry.LEASE_RENEW_FAILURES.add(1, {"baton.reason": "cas"})
                    if self.settled:
                        log.info(
                            "%s: lease lapsed while the attempt's end is written; its "
                            "record decides", self.run_id,
                        )  # fmt: skip
                        return
                    if not self.may_retake or not await self._retake():
                        self.orders.fence("the lease was taken over by another worker")
                        return
                if self.grant is not None and not self.settled:
                    revoked = await self.grant()
                    if revoked is not None:
                        self.orders.fence(revoked)
                        return
                await self._read_orders()
                self.renewal.ok()
                wait = interval
            except Exception as exc:  # a link that is down: keep training, try again
                telemetry.LEASE_RENEW_FAILURES.add(1, {"baton.reason": "error"})
                self.renewal.failed(exc)
                # A trainer at a site keeps its connection to the leaf through a WAN cut,
                # so no reconnect tells it the link is back: retry soon, to renew within
                # the TTL a cut shorter than the TTL leaves.
                wait = min(interval, RETRY_S)

    async def _read_orders(self) -> None:
        found = await self.runs.get(self.run_id)
        if found is None:
            return
        r = found[0]
        if r.state.terminal:
            self.orders.give(Order.OVER, r.reason or f"the run is {r.state.value}")
        elif r.cancel_requested is not None:
            self.orders.give(Order.CANCEL, r.cancel_requested)
        elif r.pause_requested is not None:
            self.orders.give(Order.PAUSE, r.pause_requested)
        elif r.rollback_to is not None:
            why = f"rolled back to step {r.rollback_to}"
            why += f": {r.rollback_reason}" if r.rollback_reason else ""
            self.orders.give(Order.ROLLBACK, why)
        elif r.preempt is not None:
            self.orders.preempt(r.preempt)
        if r.checkpoints_asked > self.checkpoints_served and not r.state.terminal:
            self.checkpoints_served = r.checkpoints_asked
            log.info("%s: checkpoint asked by an operator", self.run_id)
            self.send(Control(action="checkpoint"))
        if self.on_record is not None:
            self.on_record(r)

    async def _retake(self) -> bool:
        """After a lapse: take the lease again unless someone committed or moved the
        record in between, or continuing would rewind their work."""
        old = self.lease.token
        if not await self.lease.acquire():
            return False
        latest = await commit.read_latest(self.store, self.run_id)
        found = await self.runs.get(self.run_id)
        moved_on = (
            found is None
            or found[0].state.terminal
            or (found[0].token or 0) > old
            or (latest is not None and latest[0].token > old)
        )
        if moved_on:
            await self.lease.release()
            return False
        log.warning(
            "%s: lease lapsed and was re-taken; token %d -> %d", self.run_id, old, self.lease.token
        )
        self.send(Control(action="token", token=self.lease.token))
        await self.runs.update(self.run_id, transitions.retoken(old, self.lease.token))
        return True
