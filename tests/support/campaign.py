"""The fault campaign: a seeded random schedule of client operations and faults carried out
against a real stack (the hub's services, trainers and a site, under `baton up`'s
authorization), ending with the history checker (docs/verify.md, "The fault campaign").

Two halves, kept apart:

* `schedule(seed, duration_s, topology) -> list[Step]`: pure. The same seed gives the same
  steps, which the test prints before it starts, so a failing seed's schedule is read off
  its output and replayed with `BATON_CAMPAIGN_SEED=<seed>`. Steps come in lanes that never
  overlap within themselves (one trainer fault at a time, one link cut, one hub fault), each
  fault with its `hold`: how long it lasts before the driver undoes it.
* `Campaign`: the driver. It sleeps until each step's time and carries it out in a task of
  its own (a lane waits for its previous step to be undone first); every fault is undone
  after its hold, and again in `heal()`, which also runs however the test ends. Operations
  are best effort: one that cannot apply (nothing to cancel, a rollback the dispatcher
  refuses) is counted as skipped, never fatal — what the campaign judges is the history.

At the end (`settle_and_check`): every fault healed, every run the campaign started ended
by itself (bounded), each COMPLETED run with its spec's uninterrupted digest and one
`completed` event, and the checker over the whole history (with every top-up the ledger
acknowledged, and `settled`: the pool has a price).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from nats.aio.client import Client

from baton.client import calls as client
from baton.client.rebase import fork_spec
from baton.stack.cluster import current
from baton.stack.options import CLUSTER_LEASE_TTL
from shared.bus import names
from shared.bus import sourcing as sources
from shared.bus.connect import publish
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState, convert, encode
from shared.contracts.control import Pause, Resume, Rollback
from shared.contracts.events import (
    Accepted,
    CheckpointCommitted,
    Completed,
    Event,
    Rejected,
)
from shared.contracts.ledger import TopUp
from shared.contracts.pools import units
from shared.contracts.records import run_id_for
from shared.history.collect import collect
from shared.history.facts import TopUpId
from shared.history.verify import check, describe
from shared.ledger import book
from shared.state.runs import Runs
from shared.state.workers import live_workers
from tests.e2e import jobs
from tests.support.ledger import settled
from tests.support.sites import Site
from tests.support.stack import Stack, alive, children_of, eventually

SEED_VAR = "BATON_CAMPAIGN_SEED"
LENGTH_VAR = "BATON_CAMPAIGN_S"
DEFAULT_S = 300.0
"""The schedule's length (five minutes: what CI runs), unless `BATON_CAMPAIGN_S` says
otherwise."""
PERSON = "carol"
"""A person with credits in the priced pool, who may also submit at a priority that
preempts."""
SITE_SUBMITTER = "lab1-submitter"
"""Submits at the site, and (published by the operator on its subject) at the hub: the same
idempotency key names the same run at both."""
PRICE = 0.01
POOLS = f"""
[pools.default]
min_run_s = 0
max_priority = 0
price = {{ cpu = {PRICE} }}
estimate_margin = 5.0
[pools.default.owners.{PERSON}]
max_priority = 10
"""
CREDITS = 2000.0
"""What the priced owners start with: far more than every run of a campaign holds."""
SPECS: tuple[tuple[int, int, int], ...] = ((60, 5, 10), (90, 9, 10), (70, 13, 20))
"""(total steps, seed, checkpoint every): the jobs a campaign submits, each's uninterrupted
digest computed once at the start (pace 0: pace only sleeps)."""
PACES = (0.1, 0.2, 0.3)
END_WAIT_S = 420.0
"""A bound on the wait, once every fault is healed, for every run to end by itself."""
REPRO = "BATON_CAMPAIGN_SEED={seed} scripts/test.sh -m adversary -k campaign"


@dataclass(frozen=True)
class Topology:
    name: str
    hub_nodes: int
    hub_trainers: tuple[str, ...] = ("t1", "t2")
    site_trainers: tuple[str, ...] = ("lab1-trainer-1",)

    @property
    def trainers(self) -> tuple[str, ...]:
        return self.hub_trainers + self.site_trainers


SINGLE = Topology("single", hub_nodes=1)
"""One hub server (whose unsynced tail a fault loses) and the site lab1 behind a proxy."""
CLUSTER = Topology("cluster", hub_nodes=3)
"""Three hub nodes (one killed or stopped at a time) and the site lab1, its leaf behind a
proxy to the first node (whose loss cuts the link too)."""

OPERATIONS = ("submit", "person", "priority", "dual", "cancel", "pause", "rollback", "fork",
              "topup")  # fmt: skip
FAULTS = ("sigkill", "sigstop", "sigterm", "cut", "node-kill", "node-stop", "forget")
RESUME = "resume"
"""Not an operation of its own: the second half of a `pause`."""


@dataclass(frozen=True)
class Step:
    at: float
    """Seconds after the schedule's start."""
    kind: str
    """One of OPERATIONS, FAULTS or RESUME."""
    lane: str
    """Steps of one lane never overlap: the next waits for the last to be undone."""
    target: int = 0
    """Which spec (submits), trainer (trainer faults) or hub node (node faults); for a
    pause's resume, the pause's `pause_key`."""
    pace: float = 0.0
    hold: float = 0.0
    """How long a fault lasts before it is undone."""

    def __str__(self) -> str:
        extra = f" target={self.target}"
        if self.pace:
            extra += f" pace={self.pace}"
        if self.hold:
            extra += f" hold={self.hold:.1f}s"
        return f"{self.at:7.1f}s [{self.lane}] {self.kind}{extra}"


def schedule(seed: int, duration_s: float, topology: Topology) -> list[Step]:
    """The campaign of `seed`: operations and faults over `duration_s` seconds, in time
    order. Pure: a function of its arguments alone."""
    rng = random.Random(f"{seed}/{topology.name}/{duration_s}")
    steps: list[Step] = []

    def u(lo: float, hi: float) -> float:
        return round(rng.uniform(lo, hi), 1)

    # Operations: a submit of each spec first, then one every few seconds.
    t = 1.0
    for i in range(len(SPECS)):
        steps.append(Step(t, "submit", "ops", i, rng.choice(PACES)))
        t += 1.0
    kinds = ["submit", "person", "priority", "cancel", "pause", "rollback", "fork", "topup"]
    while (t := t + u(5, 12)) < duration_s:
        kind = rng.choice(kinds)
        spec = rng.randrange(len(SPECS))
        steps.append(Step(t, kind, "ops", spec, rng.choice(PACES)))
        if kind == "pause":
            steps.append(Step(round(t + u(3, 10), 1), RESUME, "resume", pause_key(t)))
    # Trainer faults, one at a time, on any trainer at the hub or the site.
    t = u(5, 10)
    while t < duration_s:
        kind = rng.choice(("sigkill", "sigkill", "sigstop", "sigterm"))
        hold = u(3, 12) if kind == "sigstop" else 0.0
        steps.append(Step(t, kind, "trainers", rng.randrange(len(topology.trainers)), 0, hold))
        t = round(t + hold + u(3, 8), 1)
    # The site's link cut; during most cuts, one job submitted at both sides.
    t = u(10, 20)
    while t < duration_s:
        hold = u(8, 20)
        steps.append(Step(t, "cut", "link", 0, 0, hold))
        if rng.random() < 0.7:
            steps.append(Step(round(t + 1, 1), "dual", "ops", rng.randrange(len(SPECS)),
                              rng.choice(PACES)))  # fmt: skip
        t = round(t + hold + u(12, 30), 1)
    # The hub: one node lost at a time (three nodes), or its unsynced tail (one node).
    t = u(15, 25)
    while t < duration_s:
        if topology.hub_nodes > 1:
            kind = rng.choice(("node-kill", "node-stop"))
            hold = u(3, 10)
            gap = u(8, 20)
        else:
            kind, hold, gap = "forget", u(15, 35), u(20, 40)
        steps.append(Step(t, kind, "hub", rng.randrange(topology.hub_nodes), 0, hold))
        t = round(t + hold + gap, 1)
    return sorted(steps, key=lambda s: s.at)


def pause_key(at: float) -> int:
    """A pause's resume names it by its time (the steps are sorted after they are made)."""
    return round(at * 10)


def seeds(default: tuple[int, ...]) -> list[int]:
    """`BATON_CAMPAIGN_SEED` (one seed, or several comma-separated), else `default`."""
    given = os.environ.get(SEED_VAR, "").strip()
    return [int(s) for s in given.split(",") if s.strip()] if given else list(default)


def length_s() -> float:
    return float(os.environ.get(LENGTH_VAR) or DEFAULT_S)


def spec_of(index: int, pace: float, key: str, **over: object) -> JobSpec:
    total, seed, every = SPECS[index]
    spec = jobs.charlm(total, pace, name=f"campaign-{index}", seed=seed, every=every)
    tree = msgspec.to_builtins(spec)
    tree.update(idempotency_key=key, checkpoint={"every_steps": every, "keep_last": 50}, **over)
    return convert(tree, JobSpec)


class Refused(Exception):
    """A submission the dispatcher refused for good (not one to try again)."""


@dataclass
class Tracked:
    """A run the campaign started."""

    run_id: str
    spec: int
    how: str
    """operator, person, priority, dual (hub and site), fork."""
    job: JobSpec
    cancelled: bool = False
    resubmitted: int = 0


@dataclass
class Campaign:
    stack: Stack
    site: Site
    topology: Topology
    seed: int
    steps: list[Step]
    nc: Client = field(init=False)
    person: Client = field(init=False)
    at_site: Client = field(init=False)
    reference: dict[int, str] = field(default_factory=dict)
    runs: dict[str, Tracked] = field(default_factory=dict)
    topups: list[tuple[TopUpId, float]] = field(default_factory=list)
    """Top-ups the ledger acknowledged, with when (time.time())."""
    forgotten: list[tuple[float, float]] = field(default_factory=list)
    """Windows (time.time()) whose writes the hub lost on purpose."""
    done: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    _stopped: set[int] = field(default_factory=set)
    _nodes_down: set[int] = field(default_factory=set)
    _nodes_stopped: set[int] = field(default_factory=set)
    _forget_copy: Path | None = None
    _paused: dict[int, str] = field(default_factory=dict)
    _t0: float = 0.0

    # -- the stack -----------------------------------------------------------------------

    async def connect(self) -> None:
        self.nc = await self.stack.client()
        self.person = await self.stack.client_as(PERSON)
        self.at_site = await self.site.client("submitter")
        for owner in (PERSON, SITE_SUBMITTER):
            await self.topup(owner, CREDITS)

    async def references(self) -> None:
        """Each spec's uninterrupted digest, trained once now with no fault."""
        ids = [await jobs.submit(self.nc, spec_of(i, 0.0, f"ref-{i}")) for i in range(len(SPECS))]
        for i, run_id in enumerate(ids):
            record = await jobs.finished(self.nc, run_id, timeout=240)
            assert record.state is RunState.COMPLETED and record.digest, record
            self.reference[i] = record.digest

    def say(self, what: str) -> None:
        line = f"{time.monotonic() - self._t0:7.1f}s {what}" if self._t0 else what
        self.log.append(line)
        print(line, flush=True)
        # Also beside the stack's logs: under xdist a passing test's output is not shown.
        with (self.stack.root.parent / "campaign.log").open("a") as f:
            f.write(line + "\n")

    # -- carrying out the schedule -------------------------------------------------------

    async def run(self) -> None:
        self._t0 = time.monotonic()
        lanes: dict[str, asyncio.Lock] = {}
        tasks: list[asyncio.Task[None]] = []
        try:
            for i, step in enumerate(self.steps):
                delay = self._t0 + step.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                lock = lanes.setdefault(step.lane, asyncio.Lock())
                tasks.append(asyncio.create_task(self._carry(i, step, lock)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _carry(self, index: int, step: Step, lock: asyncio.Lock) -> None:
        async with lock:
            late = time.monotonic() - self._t0 - step.at
            self.say(f"{step}" + (f" (late {late:.1f}s)" if late > 1 else ""))
            try:
                if step.kind in FAULTS:
                    await self._fault(step)
                else:
                    await self._operation(index, step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed[step.kind] += 1
                self.say(f"  {step.kind} failed: {exc!r}"[:400])

    async def _operation(self, index: int, step: Step) -> None:
        ops: dict[str, Callable[[], Awaitable[str | None]]] = {
            "submit": lambda: self.submit(step.target, step.pace, "operator"),
            "person": lambda: self.submit(step.target, step.pace, "person"),
            "priority": lambda: self.submit(step.target, step.pace, "priority"),
            "dual": lambda: self.dual(step.target, step.pace),
            "cancel": self.cancel,
            "pause": lambda: self.pause(pause_key(step.at)),
            RESUME: lambda: self.resume(step.target),
            "rollback": self.rollback,
            "fork": self.fork,
            "topup": lambda: self.topup(PERSON, 5.0),
        }
        said = await ops[step.kind]()
        if said is None:
            self.done[step.kind] += 1
        else:
            self.skipped[step.kind] += 1
            self.say(f"  {step.kind} skipped: {said}")

    # -- operations: each returns None when done, else why it was skipped ---------------

    async def submit(self, index: int, pace: float, how: str) -> str | None:
        key = uuid.uuid4().hex
        if how == "operator":
            job = spec_of(index, pace, key)
        else:  # a person's: priced (its own estimate), maybe urgent
            # Its own name: its holds are reckoned from its own runs' speed, not from the
            # references' (pace 0), so that a hold lasts the run (a spent one pauses it).
            job = spec_of(
                index, pace, key, name=f"{PERSON}-campaign-{index}", estimate_s=300.0,
                priority=10 if how == "priority" else 0,
            )  # fmt: skip
        tracked = Tracked(run_id="", spec=index, how=how, job=job)
        try:
            tracked.run_id = await self._send(tracked)
        except Refused as exc:
            return str(exc)
        self.runs[tracked.run_id] = tracked
        self.say(f"  {how} {tracked.run_id} spec {index} pace {pace}")
        return None

    async def _send(self, t: Tracked) -> str:
        """Submit `t` (again: the same key, the same run) until the submit stream stores it:
        a submitter retries while the hub is down."""
        if t.how == "dual":
            return await self._at_hub(t.job)
        said: list[str] = []
        failures = 0

        async def sent() -> str | None:
            nonlocal failures
            operator = t.how in ("operator", "fork")
            try:
                run_id, answer = await client.submit(
                    self.nc if operator else self.person, t.job, 10
                )
            except Exception as exc:
                said[:] = [repr(exc)]
                failures += 1
                if not operator and failures % 3 == 0:
                    # Seen after the hub's server came back on a copy of its store: the
                    # person's connection, reconnected, had no publish answered while a
                    # new connection's were. A submitter would log in again.
                    self.say(f"  {PERSON}'s submit failed {failures} times ({exc!r}): new client")
                    self.person = await self.stack.client_as(PERSON)
                return None
            if answer is None or isinstance(answer, Accepted):
                return run_id
            reason = answer.reason if isinstance(answer, Rejected) else repr(answer)
            if "try again" in reason:  # e.g. the owner's credits changing meanwhile
                said[:] = [reason]
                return None
            raise Refused(f"{t.how} submit refused: {reason}")

        try:
            return await eventually(sent, 60, f"a {t.how} submission to be stored", 1.0)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (last: {said})") from None

    async def _at_hub(self, job: JobSpec) -> str:
        """Published at the hub on the site submitter's subject (the operator may)."""
        subject = names.submit_subject(job.pool, SITE_SUBMITTER)

        async def sent() -> bool:
            try:
                await publish(self.nc.jetstream(), subject, encode(job),
                              msg_id=f"hub-{job.idempotency_key}")  # fmt: skip
            except Exception:
                return False
            return True

        await eventually(sent, 90, "the hub's copy of a job to be stored", 1.0)
        return run_id_for(job.idempotency_key or "", SITE_SUBMITTER)

    async def dual(self, index: int, pace: float) -> str | None:
        """The same job at the hub and at the site while the site is cut off."""

        async def down() -> bool:
            with contextlib.suppress(Exception):
                return "lab1" not in await sources.linked(self.nc)
            return False

        with contextlib.suppress(AssertionError):
            await eventually(down, 10, "the hub to see lab1 cut off", 0.5)
        key = uuid.uuid4().hex
        job = spec_of(index, pace, key)
        tracked = Tracked(run_id=run_id_for(key, SITE_SUBMITTER), spec=index, how="dual", job=job)
        self.runs[tracked.run_id] = tracked
        await self._at_hub(job)
        run_id, answer = await client.submit(self.at_site, job, 20, "lab1")
        assert run_id == tracked.run_id, (run_id, tracked.run_id)
        assert isinstance(answer, Accepted), answer
        self.say(
            f"  dual {run_id} spec {index} pace {pace} (site unconfirmed: {answer.unconfirmed})"
        )
        return None

    async def _live(self, state: RunState | None = None) -> list[tuple[Tracked, RunRecord]]:
        """The campaign's runs the hub holds not ended (in `state`, if given)."""
        runs = await Runs.open(self.nc.jetstream())
        out = []
        for t in list(self.runs.values()):
            found = await runs.get(t.run_id)
            if found is None or found[0].state.terminal:
                continue
            if state is None or found[0].state is state:
                out.append((t, found[0]))
        return out

    def _rng(self, salt: str) -> random.Random:
        """Choices made at the time (which live run), still a function of the seed."""
        return random.Random(f"{self.seed}/{salt}/{len(self.log)}")

    async def cancel(self) -> str | None:
        live = await self._live()
        if not live:
            return "no live run"
        t, _ = self._rng("cancel").choice(live)
        await client.cancel(self.nc, t.run_id, "the campaign's cancel")
        t.cancelled = True
        self.say(f"  cancel {t.run_id}")
        return None

    async def pause(self, index: int) -> str | None:
        live = await self._live(RunState.RUNNING)
        if not live:
            return "no running run"
        t, _ = self._rng("pause").choice(live)
        await client.steer(self.nc, Pause(run_id=t.run_id))
        self._paused[index] = t.run_id
        self.say(f"  pause {t.run_id}")
        return None

    async def resume(self, pause_index: int) -> str | None:
        run_id = self._paused.pop(pause_index, None)
        if run_id is None:
            return "nothing was paused"
        return await self._resume(run_id, 20)

    async def _resume(self, run_id: str, wait_s: float) -> str | None:
        """Once the pause took hold (it waits for a checkpoint), resume the run."""
        now = await client.await_state(self.nc, run_id, {"paused"}, wait_s)
        if now.state is not RunState.PAUSED:
            # The pause may still take hold later: the end resumes every paused run.
            return f"{run_id} is {now.state.value}, not paused"
        await client.steer(self.nc, Resume(run_id=run_id))
        self.say(f"  resume {run_id}")
        return None

    async def _committed(self, run_id: str) -> list[int]:
        events = await client.history(self.nc, run_id)
        return sorted({e.step for e in events if isinstance(e, CheckpointCommitted)})

    async def rollback(self) -> str | None:
        """A running run back to one of its committed checkpoints but the newest."""
        rng = self._rng("rollback")
        for t, _ in rng.sample(live := await self._live(RunState.RUNNING), len(live)):
            steps = await self._committed(t.run_id)
            if len(steps) >= 2:
                step = rng.choice(steps[:-1])
                await client.steer(self.nc, Rollback(run_id=t.run_id, step=step))
                self.say(f"  rollback {t.run_id} to step {step} (of {steps})")
                return None
        return "no running run with two checkpoints"

    async def fork(self) -> str | None:
        """A completed run forked, unchanged, from one of its committed checkpoints: it ends
        with the same weights."""
        runs = await Runs.open(self.nc.jetstream())
        rng = self._rng("fork")
        done = [t for t in self.runs.values() if t.how == "operator"]
        for t in rng.sample(done, len(done)):
            found = await runs.get(t.run_id)
            if found is None or found[0].state is not RunState.COMPLETED:
                continue
            steps = [s for s in await self._committed(t.run_id) if s < t.job.total_steps]
            if not steps:
                continue
            step = rng.choice(steps)
            job = fork_spec(found[0], step, [], None, uuid.uuid4().hex)
            tracked = Tracked(run_id="", spec=t.spec, how="fork", job=job)
            tracked.run_id = await self._send(tracked)
            self.runs[tracked.run_id] = tracked
            self.say(f"  fork {tracked.run_id} of {t.run_id} at step {step}")
            return None
        return "no completed run to fork"

    async def topup(self, owner: str, credits: float) -> str | None:
        entry = TopUp(owner=owner, id=uuid.uuid4().hex, amount=units(credits), by="campaign")
        if await book.write(self.nc.jetstream(), entry) is None:
            return "the ledger did not acknowledge it"
        self.topups.append((TopUpId(owner=owner, id=entry.id), time.time()))
        return None

    # -- faults --------------------------------------------------------------------------

    async def _fault(self, step: Step) -> None:
        if step.kind in ("sigkill", "sigterm", "sigstop"):
            await self._trainer_fault(step)
        elif step.kind == "cut":
            self.site.proxy.sever()
            try:
                await asyncio.sleep(step.hold)
            finally:
                self.site.proxy.restore()
                self.say("  link restored")
        elif step.kind in ("node-kill", "node-stop"):
            await self._node_fault(step)
        elif step.kind == "forget":
            await self._forget(step)
        self.done[step.kind] += 1

    async def _trainer_fault(self, step: Step) -> None:
        name = self.topology.trainers[step.target]
        pid = self.stack.sup.pid(name)
        if pid is None:  # between a death and its restart
            await asyncio.sleep(2)
            pid = self.stack.pid(name)
        if step.kind == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif step.kind == "sigterm":
            os.kill(pid, signal.SIGTERM)
        else:
            family = [pid, *children_of(pid)]
            for p in family:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
                self._stopped.add(p)
            try:
                await asyncio.sleep(step.hold)
            finally:
                self._wake()
                self.say(f"  {name} continued")
        # Capacity comes back: the supervisor restarts a trainer that died (as `baton up`).
        if step.kind != "sigstop":

            async def back() -> bool:
                new = self.stack.sup.pid(name)
                return new is not None and new != pid

            await eventually(back, 60, f"{name} to be restarted", 0.5)

    def _wake(self) -> None:
        for p in list(self._stopped):
            if alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)
            self._stopped.discard(p)

    async def _node_fault(self, step: Step) -> None:
        node = self.stack.hub.nodes[step.target]
        if step.kind == "node-kill":
            self._nodes_down.add(step.target)
            await node.kill()
        else:
            assert node.pid is not None
            self._nodes_stopped.add(step.target)
            os.kill(node.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(step.hold)
        finally:
            await self._nodes_back()
        await self.all_current()

    async def _nodes_back(self) -> None:
        for i in sorted(self._nodes_stopped):
            pid = self.stack.hub.nodes[i].pid
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGCONT)
            self._nodes_stopped.discard(i)
            self.say(f"  node {i} continued")
        for i in sorted(self._nodes_down):
            await self.stack.hub.nodes[i].start()
            self._nodes_down.discard(i)
            self.say(f"  node {i} started")

    async def all_current(self, timeout: float = 90) -> None:
        """Until every stream has a leader and every replica caught up (a clustered hub)."""
        if self.topology.hub_nodes == 1:
            return
        js = self.nc.jetstream()
        replicas = self.topology.hub_nodes

        async def caught_up() -> bool:
            try:
                streams = [i.config.name for i in await js.streams_info()]
            except Exception:
                return False
            states = await asyncio.gather(*(current(js, s, replicas) for s in streams if s))
            return bool(states) and all(states)

        await eventually(caught_up, timeout, "every stream current on every node", 0.5)

    async def _forget(self, step: Step) -> None:
        """The hub's server stopped and its store copied; after the hold, killed and started
        on the copy: what was written in between is lost, as a host crash loses JetStream's
        unsynced tail. Then each submitter that finds no record of its run submits again."""
        server = self.stack.nats
        copy = self.stack.root / "forgotten"
        await server.stop()
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(server.store_dir, copy)
        self._forget_copy = copy
        await server.start()
        began = time.time()
        try:
            await asyncio.sleep(step.hold)
        finally:
            await self._remember_copy()
            self.forgotten.append((began, time.time()))
        await self.resubmit_lost()

    async def _remember_copy(self) -> None:
        if self._forget_copy is None:
            return
        server = self.stack.nats
        await server.kill()
        shutil.rmtree(server.store_dir)
        shutil.copytree(self._forget_copy, server.store_dir)
        self._forget_copy = None
        await server.start()
        self.say("  the hub came back on the copy")

    async def resubmit_lost(self) -> None:
        runs = await Runs.open(self.nc.jetstream())
        for t in list(self.runs.values()):
            if await runs.find(t.run_id) is None:
                t.resubmitted += 1
                try:
                    await self._send(t)
                except Refused as exc:  # refused at its dispatch: no run, nothing to end
                    del self.runs[t.run_id]
                    self.say(f"  {t.run_id}: {exc}")
                    continue
                self.say(f"  {t.run_id} had no record: submitted again")

    # -- the end -------------------------------------------------------------------------

    async def heal(self) -> None:
        """Undo every fault still in force (also when the test failed)."""
        self.site.proxy.restore()
        self._wake()
        await self._nodes_back()
        await self._remember_copy()

    async def settle_and_check(self) -> None:
        await self.heal()
        await self.all_current()
        await self.resubmit_lost()
        self.say("healed; waiting for every run to end")
        records = await self.ended()
        self.say(f"every run ended: {dict(Counter(r.state.value for r in records.values()))}")
        for run_id, record in records.items():
            t = self.runs[run_id]
            if record.state is RunState.COMPLETED:
                assert record.digest == self.reference[t.spec], (
                    f"{run_id} ({t.how}, spec {t.spec}) completed with weights "
                    f"{record.digest}, not the uninterrupted run's {self.reference[t.spec]}"
                )
                events = await self.history(run_id)
                completed = [e for e in events if isinstance(e, Completed)]
                assert len(completed) == 1, f"{run_id}: {len(completed)} completed events"
            else:  # kills, cuts and preemptions never fail a run; only a cancel ends one
                what = f"{run_id} ({t.how}) ended {record.state.value}: {record.reason}"
                assert t.cancelled, what
        for run_id, record in records.items():
            if record.owner and record.price:  # priced: the reaper settles it
                await settled(self.nc, record.owner, run_id, timeout=120)
        await self.check()

    async def ended(self) -> dict[str, RunRecord]:
        """Every run's terminal record, once all have ended (a run left PAUSED, its pause
        taking hold after its resume was tried, is resumed)."""
        runs = await Runs.open(self.nc.jetstream())
        records: dict[str, RunRecord] = {}

        async def all_ended() -> bool:
            for run_id in self.runs:
                if run_id in records:
                    continue
                try:
                    found = await runs.find(run_id)
                except Exception:
                    return False
                if found is not None and found.state.terminal:
                    records[run_id] = found
                elif found is not None and found.state is RunState.PAUSED:
                    await client.steer(self.nc, Resume(run_id=run_id))
                    self.say(f"  resume {run_id} (paused at the end)")
            return len(records) == len(self.runs)

        try:
            await eventually(all_ended, END_WAIT_S, "every run to end", 2.0)
        except AssertionError:
            left = {r: await runs.find(r) for r in self.runs if r not in records}
            said = {r: (f.state.value, f.worker, f.site) if f else None for r, f in left.items()}
            for run_id in left:
                print(await self.where(run_id))
            raise AssertionError(f"runs that did not end by themselves: {said}") from None
        return records

    async def where(self, run_id: str) -> str:
        """What every side says of a run that did not end: the hub's record and the site's,
        the store's `latest`, the trainers' heartbeats and the run's last events (printed
        when the campaign fails on it, so that CI's output says why)."""

        def record(r: RunRecord | None) -> str:
            if r is None:
                return "none"
            return (f"{r.state.value} worker={r.worker} site={r.site!r} epoch={r.epoch} "
                    f"token={r.token} step={r.step} attempts={r.attempts} "
                    f"cancel={r.cancel_requested is not None}")  # fmt: skip

        lines = [f"-- {run_id} ({self.runs[run_id].how}, spec {self.runs[run_id].spec})"]
        with contextlib.suppress(Exception):
            hub = await Runs.open(self.nc.jetstream())
            lines.append(f"   hub's record:  {record(await hub.find(run_id))}")
        with contextlib.suppress(Exception):
            at_site = await self.site.client()
            site_runs = await Runs.open(at_site.jetstream(), bucket=names.site_runs_bucket("lab1"))
            lines.append(f"   site's record: {record(await site_runs.find(run_id))}")
        with contextlib.suppress(Exception):
            async with open_store(self.stack.store_url) as store:
                latest = await commit.read_latest(store, run_id)
            lines.append(f"   store's latest: {latest[0] if latest else None}")
        with contextlib.suppress(Exception):
            for w in await live_workers(self.nc.jetstream()):
                lines.append(f"   trainer {w.worker}: run={w.run_id} token={w.token} "
                             f"step={w.step} site={w.site!r} drained={w.drained}")  # fmt: skip
        with contextlib.suppress(Exception):
            for e in (await client.history(self.nc, run_id))[-25:]:
                lines.append(f"   {e.at:.1f} {msgspec.json.encode(e).decode()[:300]}")
        return "\n".join(lines)

    async def history(self, run_id: str) -> list[Event]:
        async def read() -> list[Event] | None:
            with contextlib.suppress(Exception):
                return await client.history(self.nc, run_id)
            return None

        return await eventually(read, 60, f"{run_id}'s history")

    async def check(self) -> None:
        """The history checker over everything stored, with the top-ups the ledger
        acknowledged (but those the hub lost on purpose with its tail)."""
        kept = [
            t for t, at in self.topups
            if not any(began <= at <= ended for began, ended in self.forgotten)
        ]  # fmt: skip
        async with open_store(self.stack.store_url) as store:
            history = await collect(self.nc, store)
        history = msgspec.structs.replace(history, acknowledged_topups=kept)
        found = check(history, settled_exactly=True)
        self.say(
            f"checker: {len(history.records) + len(history.archived)} records, "
            f"{len(history.events)} events, "
            f"{len(history.ledger)} ledger entries, {len(found)} violation(s)"
        )
        assert not found, "the history breaks invariants:\n" + "\n".join(map(describe, found))

    def summary(self) -> str:
        faults = sum(self.done[k] for k in FAULTS)
        return (
            f"faults done {faults}: {dict((k, self.done[k]) for k in FAULTS if self.done[k])}; "
            f"operations done {dict((k, v) for k, v in self.done.items() if k not in FAULTS)}, "
            f"skipped {dict(self.skipped)}, failed {dict(self.failed)}; "
            f"{len(self.runs)} runs ({dict(Counter(t.how for t in self.runs.values()))}), "
            f"{sum(t.resubmitted for t in self.runs.values())} submitted again after a loss"
        )


@contextlib.asynccontextmanager
async def campaign_stack(
    root: Path,
    topology: Topology,
    people: tuple[str, ...] = (PERSON,),
    env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Stack, Site]]:
    """The hub (`topology.hub_nodes` servers, the priced pool with priorities), its services,
    trainers restarted when they die (as under `baton up`), and the site lab1 behind a proxy
    with its own such trainer; `people` with their own credentials, `env` for the hub's
    services besides; stopped however the test ends."""
    pools = root / "pools.toml"
    root.mkdir(parents=True, exist_ok=True)
    pools.write_text(POOLS)
    stack = Stack(
        root / "hub", trainers=0, hub_nodes=topology.hub_nodes, people=people,
        lease_ttl=6 if topology.hub_nodes == 1 else CLUSTER_LEASE_TTL,
        env={"BATON_POOLS_FILE": str(pools), **(env or {})},
    )  # fmt: skip
    # What the hub's faults cause on purpose: requests in flight to a server that is down
    # or stopped time out, and a sweep that timed out is tried again. Never a permission.
    stack.audit.allow(r"sweep failed|nats: timeout", "the hub's servers are lost on purpose")
    try:
        await stack.start(("dispatcher", "checkpointer", "reaper"))
        for name in topology.hub_trainers:
            await stack.add_trainer(name, restart=True)
        await stack.ready(("trainer",))
        site = Site(stack, "lab1")
        await site.start(trainers=0)
        for name in topology.site_trainers:
            await site.add_trainer(name, restart=True)
        await site.linked()
        yield stack, site
    finally:
        await stack.stop()


async def run_campaign(root: Path, topology: Topology, seed: int) -> None:
    """One seed's campaign, start to verdict; prints its schedule first and, on failure, the
    seed and how to run it again."""
    steps = schedule(seed, length_s(), topology)
    faults = sum(s.kind in FAULTS for s in steps)
    print(f"\ncampaign seed {seed} on the {topology.name} hub: {len(steps)} steps, "
          f"{faults} faults, over {length_s():.0f}s")  # fmt: skip
    for step in steps:
        print(f"  {step}")
    root.mkdir(parents=True, exist_ok=True)
    (root / "campaign.log").write_text("".join(f"  {step}\n" for step in steps))
    began = time.monotonic()
    campaign: Campaign | None = None
    try:
        async with campaign_stack(root, topology) as (stack, site):
            campaign = Campaign(stack, site, topology, seed, steps)
            try:
                await campaign.connect()
                await campaign.references()
                campaign.say(f"references: {campaign.reference}")
                await campaign.run()
                await campaign.settle_and_check()
            finally:
                await campaign.heal()
                print(campaign.summary())
    except BaseException:
        print(f"\ncampaign seed {seed} ({topology.name}) FAILED after "
              f"{time.monotonic() - began:.0f}s; reproduce: {REPRO.format(seed=seed)}")  # fmt: skip
        raise
    print(f"campaign seed {seed} ({topology.name}): passed in {time.monotonic() - began:.0f}s")
