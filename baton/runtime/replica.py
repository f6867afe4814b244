"""A replica's part in its run's outer rounds (docs/diloco.md), inside the training process.

A replicated run's replicas are runs of their own (`<run>-replica-<i>`), each training the
same entry point on its own share of the data. `RunContext` drives this module: once
`restore()` has registered the model (the first object registered), `attach` makes the
replica start from the run's start state (the first replica to get there writes it; a
resumed attempt has its outer state in its checkpoint), and after every `inner_steps`-th
step, and the last, `boundary`:

1. reads the round log;
2. sends its change — the outer state it started from minus its weights — unless that
   change is already in a round (an earlier attempt sent it: it just catches up) or is
   staler than `max_staleness` (discarded, with an event saying so);
3. waits for the round that takes it, committing the round itself once every live replica
   has sent one (live: still training and in the last round), or once `round_deadline_s`
   has passed with at least `replicas.min` changes (`shared.checkpoint.rounds`: one
   manifest wins; a replica whose attempt a newer one fenced commits none);
4. applies each committed round in order to its outer state and loads the result into the
   model; its own optimizer's state stays (DiLoCo's inner state is the replica's own).

If the store cannot be reached at any of these (`REACH_S` to read the log, `LOOK_S` for one
look), or the trainer asks the attempt to stop while it waits, the boundary is noted
`skipped` and the replica trains on from the outer state its
steps began from: its next change, of the same base, covers these steps too, and a round
takes one change per replica and base, the newest. A change sent just as the store went
away may still be taken by a round the replica did not see: at its next boundary it finds
it there, and sends the steps since as a change of their own (taken against the weights
that change left it at), so nothing is lost. Its last boundary never skips: it waits for
the store.

The outer state (its round, weights and momentum) is checkpointed with the replica's own
checkpoints, so a replica that dies resumes from its last inner checkpoint, not from the
last round. In a replica of several ranks, rank 0 alone sends and commits; the others
follow the log to the round rank 0 tells them.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch

from shared.checkpoint import commit, rounds
from shared.checkpoint.rounds import Log, Weights
from shared.checkpoint.store import Store, open_store
from shared.contracts import Task, encode
from shared.contracts.child import FromChild, RoundReached
from shared.contracts.records import replica_of, replica_run_id
from shared.contracts.rounds import ReplicaDone, RoundManifest, RoundNote, RoundOutcome
from shared.errors import AlreadyExists, StaleToken, StoreUnavailable

if TYPE_CHECKING:
    from baton.runtime.group import Group

T = TypeVar("T")


class Stopping(Exception):
    """The trainer asked the attempt to stop while it waited for a round."""


Fate = Literal["joined", "discarded", "overtaken"]
"""What became of a change sent: in a round, too stale for one, or another change of the
replica's, of the same base, went in instead."""

REACH_S = 5.0
"""How long a boundary tries to read the round log before the replica trains on without."""
POLL_S = (0.05, 1.0)
"""The wait for a round polls the store this often, doubling from the first to the second."""
LOOK_S = 30.0
"""A bound on one store operation or one look at the log, beyond the time its bytes take at
`SLOWEST_BPS`: a reply that never comes is no reply (what a look read is kept)."""
SLOWEST_BPS = 1e6
"""The slowest link to the store a replica's looks allow for: a look may read a mean per
round it catches up, each as large as the model in fp32."""
UNREACHABLE = (StoreUnavailable, OSError, TimeoutError)
"""What a store out of reach raises (a permanent error, a damaged change, is not one)."""


class Replica:
    """The replica's outer state and its course through the rounds. Registered with the
    checkpoint like any object with `state_dict()`."""

    def __init__(self, task: Task, store_url: str, send: Callable[[FromChild], None],
                 group: Group | None) -> None:  # fmt: skip
        found = replica_of(task.run_id)
        if found is None or task.spec.replica is None:
            raise ValueError(f"{task.run_id} is not a replica's run")
        self.run_id, self.index = found
        self.spec = task.spec
        self.outer = task.spec.outer
        self.store_url = store_url
        self._send = send
        self._group = group
        self.base = 0
        """The committed round the outer state is of."""
        self.params: Weights = {}
        self.momentum: Weights = {}
        self.model: torch.nn.Module | None = None
        self._log = Log(None, self.run_id)  # type: ignore[arg-type]  # a store per boundary
        self._stopping: Callable[[], bool] = bool

    # -- checkpointed state ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base, "outer": dict(self.params), "momentum": dict(self.momentum)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = int(state["base"])
        self.params = {n: t.to(torch.float32).clone() for n, t in state["outer"].items()}
        self.momentum = {n: t.to(torch.float32).clone() for n, t in state["momentum"].items()}

    # -- the course ------------------------------------------------------------------------

    def attach(self, model: object) -> None:
        """After `restore()`: `model` (the first object registered) is what the rounds
        average. A fresh replica starts from the run's start state."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                "a replicated run averages its model's parameters: register the model first,"
                f" restore(model=model, ...), not a {type(model).__qualname__}"
            )
        self.model = model
        if self.params:
            return  # resumed: the checkpoint held the outer state
        local = self._weights()
        self.params = asyncio.run(self._start(local))
        self.momentum = {n: torch.zeros_like(t) for n, t in self.params.items()}
        self._load(self.params)

    async def _start(self, local: Weights) -> Weights:
        async with open_store(self.store_url) as store:
            return await rounds.put_start(store, self.run_id, local)

    def due(self, step: int, final: bool) -> bool:
        return final or step % self.outer.inner_steps == 0

    def boundary(
        self, step: int, token: int, final: bool, stopping: Callable[[], bool] = bool
    ) -> None:
        """At a round boundary (`due`): steps 1-4 of the module's docstring. `stopping`:
        whether the trainer asked the attempt to stop, which ends a wait for a round (not
        the last one's) as if the store were out of reach."""
        if self._group is not None and self._group.rank > 0:
            return self._follow(step)
        self._stopping = stopping
        verdict = asyncio.run(self._boundary(step, token, final))
        if self._group is not None:
            self._group.share(f"round-{step}", verdict)
        return None

    def finished(self, step: int) -> None:
        """The replica's last step is done and its last change is in a round (or
        discarded): no round waits for it any more."""
        if self._group is not None and self._group.rank > 0:
            return
        done = ReplicaDone(replica=self.index, step=step, round=self.base)
        asyncio.run(self._mark_done(done))

    async def _mark_done(self, done: ReplicaDone) -> None:
        key, data = rounds.done_key(self.run_id, done.replica), encode(done)
        async with open_store(self.store_url) as store:
            await self._persist(True, partial(_put, store, key, data))

    # -- internals -------------------------------------------------------------------------

    async def _boundary(self, step: int, token: int, final: bool) -> str:
        """Returns the round the outer state is now of, for a group's other ranks."""
        async with open_store(self.store_url) as store:
            self._log.store = store
            origin = (self.base, _copy(self.params), _copy(self.momentum))
            try:
                await self._round(store, step, token, final, origin[1])
            except (*UNREACHABLE, Stopping) as exc:  # never at the last boundary
                # Train on from the outer state the steps began from; what was read is kept.
                self.base, self.params, self.momentum = origin
                why = f"the store could not be reached ({type(exc).__name__}: {exc})"
                reason = str(exc) if isinstance(exc, Stopping) else why
                self._note("skipped", step, self._log.head, detail=f"{reason}; training on")
            return str(self.base)

    async def _round(
        self, store: Store, step: int, token: int, final: bool, frame: Weights
    ) -> None:
        """Steps 2-4 of the module's docstring. `frame`: the weights the change to send is
        taken against (the outer state the steps began from)."""
        log = self._log
        await self._persist(final, log.refresh, REACH_S)
        base, began, sent, received = self.base, time.monotonic(), -log.sent, log.received
        pending = base  # the base of the replica's change to look for in the log
        while True:
            taken = log.taken.get((self.index, pending))
            if taken is not None:
                mine = next(c for c in log.manifests[taken - 1].changes if c.replica == self.index)
                if mine.step >= step and pending == base:  # these very steps, sent before
                    await self._catch_up(log, taken)
                    self._note("joined", step, taken, detail="sent by an earlier attempt")
                    return
                # A change of these weights went into round `taken` unbeknown to this replica
                # (cut off as it sent it): the steps since go as a change of their own.
                frame = {n: frame[n] - t for n, t in rounds.decode_weights(
                    await self._persist(final, partial(log.change, mine.key))).items()}  # fmt: skip
                await self._persist(final, partial(self._catch_up, log, log.head, model=False))
            elif log.head - self.base > self.outer.max_staleness:
                await self._persist(final, partial(self._catch_up, log, log.head))
                self._note("discarded", step, self.base, base=base,
                           detail=self._stale(base, self.base))  # fmt: skip
                return
            change = {n: frame[n] - w for n, w in self._weights().items()}
            data = rounds.encode_weights(change, self.outer.precision)
            key = rounds.change_key(self.run_id, self.base, self.index, token, step)
            await self._persist(final, partial(_put, store, key, data))
            log.cache[key] = data
            sent, pending = sent + len(data), self.base
            self._note("waiting", step, log.head)
            outcome = await self._wait(log, key, token, final)
            if outcome == "overtaken":
                continue  # an earlier change of this replica went in instead: send the rest
            waited, got = time.monotonic() - began, log.received - received
            sent += log.sent  # and the means it stored, closing rounds
            if outcome == "discarded":
                self._note(outcome, step, self.base, base=base, waited_s=waited, sent_bytes=sent,
                           received_bytes=got, detail=self._stale(pending, self.base))  # fmt: skip
                return
            m = log.manifests[self.base - 1]
            self._note(
                outcome, step, self.base, base=base, waited_s=waited, sent_bytes=sent,
                received_bytes=got, replicas=[c.replica for c in m.changes],
                stragglers=m.stragglers, closed_by=m.closed_by, deadline=m.deadline,
            )  # fmt: skip
            return

    async def _persist(self, final: bool, op: Callable[[], Awaitable[T]], bound: float = 0) -> T:
        """`op`, bounded (a reply that never comes is no reply); out of reach, raised —
        but at the last boundary tried again until the store is back: the replica's last
        change must not be lost."""
        delay, told = POLL_S[0], False
        while True:
            try:
                async with asyncio.timeout(bound or self._bound()):
                    return await op()
            except UNREACHABLE as exc:
                if not final:
                    raise
                if not told:
                    print(f"baton: the store is out of reach ({type(exc).__name__}); the last"
                          " change waits for it", file=sys.stderr)  # fmt: skip
                told = True
            await asyncio.sleep(delay)
            delay = min(POLL_S[1], delay * 2)

    def _bound(self) -> float:
        """`LOOK_S`, and the time to read a mean for every round to catch up, plus one."""
        rounds_behind = max(0, self._log.head - self.base) + 1
        size = sum(t.numel() * 4 for t in self.params.values())
        return LOOK_S + rounds_behind * size / SLOWEST_BPS

    async def _wait(self, log: Log, key: str, token: int, final: bool) -> Fate:
        """Until the change `key` is in a committed round ("joined"), or too stale to be
        ("discarded"), or an earlier change of the same base went in instead ("overtaken");
        the outer state follows every round committed meanwhile."""
        opened, delay = time.monotonic(), POLL_S[0]
        while True:
            if not final and self._stopping():
                raise Stopping("the attempt was asked to stop")
            outcome, opened = await self._persist(
                final, partial(self._poll, log, key, token, opened)
            )
            if outcome == "closed":
                delay = POLL_S[0]
                continue  # whoever won, the next refresh reads it
            if outcome is not None:
                if outcome != "overtaken":
                    self._load(self.params)
                return cast(Fate, outcome)
            await asyncio.sleep(delay)
            delay = min(POLL_S[1], delay * 2)

    async def _poll(
        self, log: Log, key: str, token: int, opened: float
    ) -> tuple[str | None, float]:
        """One look at the log: the change's fate if known, or "closed" if this replica
        committed the open round (or raced another to it); when the open round opened."""
        await self._catch_up(log, log.head, model=False)
        base = rounds.parse_change(key)[0]
        for manifest in await log.refresh():
            await self._apply(log, manifest)
            opened = time.monotonic()
            if any(c.key == key for c in manifest.changes):
                return "joined", opened
            if any(c.replica == self.index and c.base == base for c in manifest.changes):
                return "overtaken", opened
        if log.head - base > self.outer.max_staleness:
            return "discarded", opened
        keys = await log.candidates(self.outer.max_staleness)
        done = await log.done()
        sent = {rounds.parse_change(k)[1] for k in keys}
        missing = log.live(done, self.spec.max_replicas) - sent
        waited = time.monotonic() - opened
        late = waited >= self.outer.round_deadline_s
        enough = len(sent) >= min(self.spec.min_replicas, self.spec.max_replicas - len(done))
        # Complete: the first of the replicas in it commits (one closer, not a race of
        # them); late: any, so that a closer gone quiet holds nothing up.
        first = bool(sent) and not missing and self.index == min(sent)
        if enough and (first or late):
            await self._fenced(log.store, token)
            stragglers = sorted(set(range(self.spec.max_replicas)) - done - sent)
            await log.close(
                keys, self.params, self.momentum, self.outer, closer=self.index, token=token,
                stragglers=stragglers, deadline=bool(missing), waited_s=waited,
            )  # fmt: skip
            return "closed", opened
        return None, opened

    async def _fenced(self, store: Store, token: int) -> None:
        """Refuse to commit a round from an attempt its replica's run has moved past (a
        newer attempt's checkpoint is committed): a zombie may waste a round, never write
        one."""
        found = await commit.read_latest(store, replica_run_id(self.run_id, self.index))
        if found is not None and found[0].token > token:
            raise StaleToken(
                f"{replica_run_id(self.run_id, self.index)}: token {token} is fenced by"
                f" {found[0].token}; this attempt commits no round"
            )

    async def _catch_up(self, log: Log, upto: int, *, model: bool = True) -> None:
        """Apply the committed rounds after the outer state's, up to `upto`."""
        while self.base < upto:
            await self._apply(log, log.manifests[self.base])
        if model:
            self._load(self.params)

    async def _apply(self, log: Log, manifest: RoundManifest) -> None:
        if manifest.round != self.base + 1:
            return  # applied already (the log is read in order)
        await log.apply(manifest, self.params, self.momentum, self.outer)
        self.base = manifest.round

    def _follow(self, step: int) -> None:
        """A group's rank other than 0: to the round rank 0 reached, by the same log."""
        assert self._group is not None
        upto = int(self._group.shared(f"round-{step}"))

        async def go() -> None:
            async with open_store(self.store_url) as store:
                self._log.store = store
                while self._log.head < upto:
                    await self._log.refresh()
                await self._catch_up(self._log, upto)

        asyncio.run(go())

    def _stale(self, base: int, head: int) -> str:
        return (
            f"a change made from round {base} is {head - base} rounds behind round {head},"
            f" more than max_staleness {self.outer.max_staleness}: discarded"
        )

    def _weights(self) -> Weights:
        assert self.model is not None
        return {
            n: p.detach().to("cpu", torch.float32, copy=True)
            for n, p in self.model.named_parameters()
        }

    def _load(self, weights: Weights) -> None:
        assert self.model is not None
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(weights[n].to(p.device, p.dtype))

    def _note(self, outcome: RoundOutcome, step: int, round_: int, *, base: int | None = None,
              **more: Any) -> None:  # fmt: skip
        base = self.base if base is None else base
        note = RoundNote(outcome=outcome, replica=self.index, step=step, base=base, round=round_,
                         **more)  # fmt: skip
        self._send(RoundReached(note=note))


async def _put(store: Store, key: str, data: bytes) -> None:
    with contextlib.suppress(AlreadyExists):  # landed before, its reply lost
        await store.put_once(key, data)


def _copy(weights: Weights) -> Weights:
    return {n: t.clone() for n, t in weights.items()}
