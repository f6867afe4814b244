"""Holding a rank of another trainer's group (`group.py` says how groups form and break).

A trainer that takes a `RankCall` joins the group of that epoch — if it is still forming —
by writing its member key, and keeps the call in hand until the group forms: a call handed
back (the trainer stops, or gives way to an older group) goes to the next idle trainer. Once
the leader writes the group's address, the trainer acks the call and runs its rank's
process. It reports through its key: renewed every half second while it lives, `exited` with
the exit code (and the tail of the output when the user's code failed) once the process
ends, kept until the leader has ended the group. It kills its process the moment the group's
key is gone or names another epoch, so no rank outlives its group.

The run's lease, its record and its commits are the leader's alone: a member writes only
its own key, and its process's files carry the epoch, which the store fences.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from services.trainer.child_proc import FINISH_GRACE_S, OUTPUT_DRAIN_S, Child, Zygote, tail_of
from services.trainer.forming import FORM_POLL_S, GIVE_WAY_S, POLL_S
from services.trainer.group import local_rank
from shared.bus import names
from shared.contracts.child import (
    EXIT_USER_ERROR,
    Control,
    Finished,
    Launch,
    Rendezvous,
    StepDone,
)
from shared.contracts.groups import GroupKey, MemberKey, RankCall
from shared.state.groups import GroupStore, older_on_either_side
from shared.waits import wait_set

log = logging.getLogger("baton.trainer")

GROW_YIELD_S = 5.0
"""How long an offer to grow a group stays off the queue when other work was waiting."""


class Member:
    def __init__(
        self,
        groups: GroupStore,
        zygote: Zygote,
        call: RankCall,
        worker: str,
        store_url: str,
        work_dir: Path,
        signals: tuple[asyncio.Event, asyncio.Event],
        publish_output: Callable[[str, bytes], Awaitable[None]],
        ack_wait_s: float,
        site: str = "",
        other: GroupStore | None = None,
    ) -> None:
        """`other`: at a site, the other side's groups (`older_on_either_side`)."""
        self.groups = groups
        self.other = other
        self.zygote = zygote
        self.call = call
        self.task = call.task
        self.run_id = call.task.run_id
        self.rank: int | None = call.rank
        self.token = call.epoch
        """The group's epoch (the heartbeat shows it as the token this trainer works under)."""
        self.worker = worker
        self.store_url = store_url
        self.log_path = work_dir / "logs" / f"{self.run_id}.log"
        self.stop, self.hurry = signals
        self._publish_output = publish_output
        self._ack_wait_s = ack_wait_s
        self.step = 0
        self.finished = False
        """This rank's process reported `Finished`: it is leaving by itself."""
        self.key = names.member_key(self.run_id, call.epoch, call.rank)
        self.me = MemberKey(
            run_id=self.run_id, epoch=call.epoch, rank=call.rank, worker=worker,
            host=socket.gethostname(), site=site,
        )  # fmt: skip
        self._child: Child | None = None

    async def run(self, msg: Msg) -> None:
        group = await self._group()
        if group is not None and group.formed and self.call.grow:
            await self._offer(msg, group)
            return
        if group is None or group.formed:  # a call of an epoch that is over, or taken
            await msg.ack()
            return
        if not await self.groups.claim(self.key, self.me):
            await msg.ack()  # someone holds this rank already
            return
        try:
            formed = await self._wait_formed(msg)
            if formed is None:
                return
            await msg.ack()
            await self._train(formed)
        finally:
            await self.groups.delete(self.key)

    async def _offer(self, msg: Msg, group: GroupKey) -> None:
        """An elastic group trains below its `max` and offers a rank: hold the offer — its
        leader then stops the group at its next step boundary and forms it again, larger,
        under a new epoch — unless other work waits in the pool. Growth takes only trainers
        nothing else wants: a queued task or call, or another group forming, comes first
        (the offer goes back for `GROW_YIELD_S`; one that keeps finding other work is
        dropped after its deliveries, and the group grows at its next forming)."""
        pending = msg.metadata.num_pending or 0
        if pending or await self.groups.others_forming(self.task.spec.pool, self.run_id):
            log.info("%s: offer to grow to %d ranks left for other work of the pool",
                     self.run_id, group.ranks + 1)  # fmt: skip
            await msg.nak(delay=GROW_YIELD_S)
            return
        if not await self.groups.claim(self.key, self.me):
            await msg.ack()
            return
        log.info("%s: offered to grow its group (%d ranks, epoch %d)", self.run_id,
                 group.ranks, group.epoch)  # fmt: skip
        touched = time.monotonic()
        try:
            while (await self._group()) is not None:
                if self.stop.is_set():
                    await msg.nak()
                    return
                await self.groups.put(self.key, self.me)
                if time.monotonic() - touched > self._ack_wait_s / 3:
                    touched = time.monotonic()
                    await msg.in_progress()
                await wait_set(self.stop, POLL_S)
            await msg.ack()  # the group it offered itself to is over: it forms again
        finally:
            await self.groups.delete(self.key)

    def orphaned(self, reason: str) -> None:
        """The reaper saw this worker run a run that is not its own any more: stop."""
        log.warning("%s: rank %s killed: %s", self.run_id, self.rank, reason)
        if self._child is not None:
            self._child.kill()

    async def _group(self) -> GroupKey | None:
        group = await self.groups.group(self.task.spec.pool, self.run_id)
        return group if group is not None and group.epoch == self.call.epoch else None

    async def _wait_formed(self, msg: Msg) -> GroupKey | None:
        """The group once formed with this trainer in it; None if the call was answered
        otherwise (the group is over, or gave this rank to another, or this trainer gave
        way or is stopping)."""
        touched = kept = time.monotonic()
        while True:
            await wait_set(self.stop, FORM_POLL_S)
            if self.stop.is_set():
                await msg.nak()  # to the next idle trainer, at once
                return None
            group = await self._group()
            if group is None:
                await msg.ack()
                return None
            if group.formed:
                if self.worker in group.members[1:]:
                    # Its rank: its place among the slots held (an elastic group may form
                    # without some of the slots it called for).
                    self.rank = group.members.index(self.worker)
                    return group
                await msg.ack()
                return None
            if time.monotonic() - kept < POLL_S:
                continue  # the rest at the slower cadence
            kept = time.monotonic()
            older = await older_on_either_side(group, self.groups, self.other)
            if older is not None:
                log.info("%s: rank %d given back: the older run %s is forming",
                         self.run_id, self.call.rank, older.run_id)  # fmt: skip
                await msg.nak(delay=GIVE_WAY_S)
                return None
            await self.groups.put(self.key, self.me)
            if time.monotonic() - touched > self._ack_wait_s / 3:
                touched = time.monotonic()
                await msg.in_progress()

    async def _train(self, group: GroupKey) -> None:
        rank = group.members.index(self.worker)
        child = self._child = await self.zygote.fork()
        rendezvous = Rendezvous(
            epoch=group.epoch, rank=rank, world_size=group.ranks,
            local_rank=local_rank(group.hosts, rank), addr=group.addr, port=group.port,
            timeout_s=self.task.spec.collective_timeout_s,
        )  # fmt: skip
        launch = Launch(
            task=self.task, token=group.epoch, worker=self.worker, store_url=self.store_url,
            group=rendezvous,
        )  # fmt: skip
        child.send(launch)
        log.info("%s: rank %d of %d, epoch %d", self.run_id, rank, group.ranks,
                 group.epoch)  # fmt: skip
        self.me = msgspec.structs.replace(self.me, state="running")
        copying = asyncio.create_task(
            child.copy_output(self.log_path, lambda b: self._publish_output(self.run_id, b))
        )
        reading = asyncio.create_task(self._read(child))
        exited = asyncio.ensure_future(child.wait())
        try:
            await self._follow(child, exited)
            code = await exited  # the group may have ended it: killed, and not yet reaped
            await asyncio.wait({copying}, timeout=OUTPUT_DRAIN_S)
            self.me = msgspec.structs.replace(
                self.me, state="exited", code=code, step=self.step,
                user_error=code == EXIT_USER_ERROR, tail=tail_of(self.log_path) if code else "",
            )  # fmt: skip
            log.info("%s: rank %d's process exited %d", self.run_id, rank, code)
            # Stay until the leader has read how this rank ended: it ends the group.
            while await self._group() is not None:
                with contextlib.suppress(Exception):
                    await self.groups.put(self.key, self.me)
                await asyncio.sleep(POLL_S)
        finally:
            child.kill()
            await child.wait()
            for t in (copying, reading):
                t.cancel()
            await asyncio.gather(copying, reading, return_exceptions=True)
            self._child = None

    async def _follow(self, child: Child, exited: asyncio.Future[int]) -> None:
        """Until the process exits: renew this rank's key, pass a stop on, and kill the
        process the moment the group is over."""
        asked = False
        while not exited.done():
            await asyncio.wait({exited}, timeout=POLL_S)
            if exited.done():
                return
            if self.stop.is_set() and not asked:
                # A preemption notice for this rank: every rank checkpoints at the same
                # step boundary (the processes agree on it) and the group hands over.
                child.send(Control(action="stop"))
                asked = True
            if self.hurry.is_set():
                child.kill()
            try:
                alive = await self._group() is not None
                await self.groups.put(self.key, msgspec.structs.replace(self.me, step=self.step))
            except Exception:  # a blip: the keys outlive a few misses
                continue
            if not alive:
                await self._end(child)
                return

    async def _end(self, child: Child) -> None:
        """The group is over: no rank outlives it. A process that finished is leaving by
        itself and gets `FINISH_GRACE_S` to do so; any other is killed at once."""
        if not self.finished:
            log.warning("%s: the group of epoch %d is over; rank %d's process killed",
                        self.run_id, self.call.epoch, self.call.rank)  # fmt: skip
            child.kill()
        elif not await child.exit_or_kill():
            log.info("%s: rank %d's process finished but did not exit within %.0fs; stopped",
                     self.run_id, self.call.rank, FINISH_GRACE_S)  # fmt: skip

    async def _read(self, child: Child) -> None:
        async for msg in child.messages():
            if isinstance(msg, StepDone):
                self.step = msg.step
            elif isinstance(msg, Finished):
                self.finished = True
