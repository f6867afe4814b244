"""A hub of three nats-servers loses machines, and no run notices.

One stack for the module (3 hub nodes, every stream and bucket on all three; the hub's
services, a trainer at the hub and a site whose leaf dials every node): each test loses
nodes — SIGKILLed leaders, a wiped store, a rolling restart — and requires of the runs that
lived through it what an uninterrupted hub gives: COMPLETED with the reference's weights,
one attempt, nothing fenced or handed over, every acknowledged submission run once. (The
reaper's silence watch runs throughout: no election may pass for a silent trainer.)

And a trainer's host that goes silent costs its run seconds, not the clustered hub's 30 s
lease TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from baton.stack.cluster import current, leader_of
from baton.stack.natsserver import NatsServer
from baton.stack.options import CLUSTER_LEASE_TTL
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import Fenced, HandedOver, Progress, Redispatched, Started
from shared.state.runs import Runs
from shared.state.workers import live_workers
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.cli import REPO, run_baton
from tests.support.hosts import SILENT_HOST_S, stop_host
from tests.support.ledger import balanced, topup
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.asyncio(loop_scope="module")]

SITE_TRAINER = "lab1-trainer-1"
PRICE = 0.01
"""Credits per trainer-second: carol's runs are charged (the operator's cost nothing)."""
HUB_STREAMS = {s for s in names.ALL_STREAMS if s != names.OUTBOX_STREAM} | {
    f"KV_{b}"
    for b in (
        names.RUNS_BUCKET, names.LEASES_BUCKET, names.WORKERS_BUCKET, names.POOLS_BUCKET,
        names.SITES_BUCKET, names.LIVE_BUCKET,
    )
}  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hub(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    root = tmp_path_factory.mktemp("cluster")
    pools = root / "pools.toml"
    pools.write_text(f"[pools.default]\nprice = {{ cpu = {PRICE} }}\n")
    s = Stack(
        root / "hub", trainers=1, lease_ttl=CLUSTER_LEASE_TTL, hub_nodes=3, people=("carol",),
        env={"BATON_POOLS_FILE": str(pools)},
    )  # fmt: skip
    # Requests in flight when a node is killed time out, and a sweep then fails and is
    # tried again: that is what these tests do. A refused permission is never allowed.
    s.audit.allow(r"sweep failed|nats: timeout", "the hub's nodes are killed on purpose")
    try:
        await s.start()
        site = Site(s, "lab1", direct=True)
        await site.start(trainers=1)
        await all_current(await s.client())
        yield s
    finally:
        await s.stop()


def charlm(total: int, pace: float, key: str) -> JobSpec:
    """The character model with a plain DataLoader, its position in `ctx.cursor`."""
    return job(
        name="charlm-cluster",
        entry_point="examples.charlm:train",
        total_steps=total,
        seed=23,
        checkpoint={"every_steps": 25},
        config={"data": "cursor", "pace": pace},
        idempotency_key=key,
    )


_reference: dict[int, str] = {}


async def reference(nc: Client, total: int) -> str:
    """The digest of an uninterrupted run (pace only sleeps)."""
    if total not in _reference:
        rec = await finished(nc, await submit(nc, charlm(total, 0.0, f"ref-{total}")), 120)
        assert rec.state is RunState.COMPLETED and rec.digest, rec
        _reference[total] = rec.digest
    return _reference[total]


async def all_current(nc: Client, timeout: float = 60) -> None:
    """Until every stream and bucket has a leader and two caught-up followers."""
    js = nc.jetstream()

    async def caught_up() -> bool:
        try:
            streams = [i.config.name for i in await js.streams_info()]
        except Exception:
            return False  # no meta leader yet
        if not set(streams) >= HUB_STREAMS:
            return False  # the meta leader lists only streams it has heard of since
        states = await asyncio.gather(*(current(js, s, 3) for s in streams if s))
        return all(states)

    await eventually(caught_up, timeout, "every stream to be current on all three nodes", 0.25)


class Submitter:
    """Submits a short job every `every` seconds while the nodes are lost; keeps the ids
    of those the submit stream acknowledged, answered by the dispatcher in time or not (a
    publish that raised may or may not have been stored: it is not counted)."""

    def __init__(self, nc: Client, every: float = 0.7) -> None:
        self.nc = nc
        self.acked: list[str] = []
        self.unanswered = 0
        self.errors: list[str] = []
        self._task = asyncio.create_task(self._run(every))

    async def _run(self, every: float) -> None:
        from baton.client import calls as client

        i = 0
        while True:
            i += 1
            spec = job(name="short", total_steps=4, checkpoint={"every_steps": 2})
            try:
                run_id, answer = await client.submit(self.nc, spec, 5)
            except Exception as exc:  # not stored, or stored unconfirmed: either is allowed
                self.errors.append(repr(exc))
            else:  # stored: the stream acknowledged it
                assert answer is None or type(answer).__name__ == "Accepted", answer
                self.acked.append(run_id)
                self.unanswered += answer is None
            await asyncio.sleep(every)

    async def one_more(self) -> None:
        """Until one more submission is stored: each node's loss falls among them."""
        seen = len(self.acked)

        async def stored() -> bool:
            return len(self.acked) > seen

        await eventually(stored, 60, f"a submission to be stored (errors: {self.errors[-3:]})")

    async def stop(self) -> list[str]:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return self.acked


async def each_ran_once(nc: Client, run_ids: list[str]) -> None:
    """Every run COMPLETED, in one attempt that started once."""
    assert run_ids, "no submission was acknowledged"
    for run_id in run_ids:
        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED and record.attempts == 1, record
        events = await history(nc, run_id)
        started = [e for e in events if isinstance(e, Started)]
        assert len(started) == 1, f"{run_id} started {len(started)} times"
        assert not [e for e in events if isinstance(e, Fenced | Redispatched | HandedOver)]


def untroubled(log: EventLog, record: RunRecord, want: str) -> None:
    assert record.state is RunState.COMPLETED, record
    assert record.digest == want, "weights differ from the uninterrupted reference"
    assert record.attempts == 1 and len(log.of(Started)) == 1, log.of(Started)
    lost = log.of(Fenced) + log.of(Redispatched) + log.of(HandedOver)
    assert not lost, f"the run noticed the hub's loss: {lost}"


async def wrote_again(js: JetStreamContext) -> None:
    """Until the runs bucket takes a write (a majority is up and every leader elected)."""

    async def writes() -> bool:
        try:
            await js.publish(f"$KV.{names.LIVE_BUCKET}.probe", b"", timeout=1)
        except Exception:
            return False
        return True

    await eventually(writes, 60, "the hub to take writes again", 0.2)


class Cli:
    """The `baton` command as the operator runs it against the clustered hub: every node's
    URL, the operator's credentials."""

    def __init__(self, hub: Stack) -> None:
        self.env = {
            **os.environ, "NATS_URL": hub.hub.url, "BATON_STORE": hub.store_url,
            "NATS_AUTH_FILE": str(hub.root / "auth" / "operator.env"),
        }  # fmt: skip

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "baton", *args, cwd=REPO, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    async def run(self, *args: str) -> tuple[int, str, str]:
        return await run_baton(*args, env=self.env)


async def submit_patiently(nc: Client, spec: JobSpec) -> str:
    """Submit while a node is down: the publish is retried (the same idempotency key, so
    it is one submission) until the submit stream has a leader again."""
    from baton.client import calls as client

    async def submitted() -> tuple[str, object] | None:
        try:
            return await client.submit(nc, spec, 40)
        except Exception:
            return None

    run_id, answer = await eventually(submitted, 60, "the submission to be stored", 0.2)
    # None: stored, but the answer could not be read yet (the events stream electing).
    assert answer is None or type(answer).__name__ == "Accepted", answer
    return run_id


class MidRun:
    """The character model training (paced to outlast the losses a test inflicts) while a
    `Submitter` submits short jobs; `ends_untroubled` then holds them to an undisturbed
    hub's results."""

    TOTAL = 240
    PACE = 0.15

    def __init__(self, nc: Client, want: str, run_id: str, submitter: Submitter) -> None:
        self.nc = nc
        self.want = want
        self.run_id = run_id
        self.log = EventLog(nc, run_id)
        self.submitter = submitter

    @classmethod
    async def start(
        cls, hub: Stack, key: str, pace: float = PACE, person: str | None = None
    ) -> MidRun:
        """`pace` (seconds a step sleeps) sizes the run to the losses the test inflicts;
        `person` submits it (else the operator)."""
        nc = await hub.client()
        want = await reference(nc, cls.TOTAL)
        by = await hub.client_as(person) if person else nc
        spec = charlm(cls.TOTAL, pace, key)
        if person:  # its own name: priced by its own estimate, not the reference's speed
            spec = msgspec.structs.replace(spec, name=f"{person}-charlm", estimate_s=120.0)
        run_id = await submit(by, spec)
        run = cls(nc, want, run_id, Submitter(await hub.client()))
        await run.log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 10, 60, "step 10")
        return run

    async def ends_untroubled(self) -> None:
        found = await (await Runs.open(self.nc.jetstream())).get(self.run_id)
        assert found is not None and not found[0].state.terminal, "the run ended too soon"
        await self.submitter.one_more()
        acked = await self.submitter.stop()
        record = await finished(self.nc, self.run_id, timeout=180)
        print(
            f"{self.run_id}: {len(acked)} submissions stored ({self.submitter.unanswered} "
            f"unanswered in time), refused: {self.submitter.errors}"
        )
        untroubled(self.log, record, self.want)
        self.log.close()
        await each_ran_once(self.nc, acked)


async def test_each_leader_killed_in_turn_mid_run(hub: Stack) -> None:
    """SIGKILL the leader of the task queue, then of the leases bucket, the runs bucket, the
    credits ledger and the events stream, each node back and caught up before the next loss.
    The run is carol's, in a pool with a price: held once, settled once, to the unit.

    The operator follows it all with `baton watch`, which must see it to COMPLETED, and runs
    `status`, `runs` and `logs` the moment each leader dies: each rides the election (seen
    before: each gave up with "JetStream did not answer")."""
    nc = await hub.client()
    topped = await topup(nc, "carol", 5.0)
    run = await MidRun.start(hub, "leaders", pace=0.35, person="carol")  # five losses
    js = run.nc.jetstream()
    watch = await Cli(hub).start("watch", run.run_id)
    streams = (
        names.TASKS_STREAM, f"KV_{names.LEASES_BUCKET}", f"KV_{names.RUNS_BUCKET}",
        names.LEDGER_STREAM, names.EVENTS_STREAM,
    )  # fmt: skip
    try:
        for stream in streams:
            await run.submitter.one_more()
            node = hub.hub.node(await leader_of(js, stream))
            print(f"{stream}: SIGKILL its leader, {node.server_name}")
            await node.kill()
            commands = (("status", run.run_id), ("runs", "--all"), ("logs", run.run_id))
            answers = await asyncio.gather(*(Cli(hub).run(*c) for c in commands))
            for command, (code, _out, err) in zip(commands, answers, strict=True):
                assert code == 0, f"baton {' '.join(command)} with {stream}'s leader lost: {err}"
            await wrote_again(js)
            await node.start()
            await all_current(run.nc)
        await run.ends_untroubled()
        out, err = await asyncio.wait_for(watch.communicate(), 120)
    finally:
        if watch.returncode is None:
            watch.kill()
            await watch.wait()
    assert watch.returncode == 0, (out.decode()[-2000:], err.decode())
    assert "completed" in out.decode(), out.decode()[-2000:]
    await balanced(nc, "carol", run.run_id, topped, PRICE)


async def test_a_node_whose_store_was_wiped_catches_up(hub: Stack) -> None:
    """A node comes back on an empty disk: it takes every stream from its peers, and the
    hub serves runs as before."""
    nc = await hub.client()
    node = hub.hub.nodes[1]
    await node.kill()
    shutil.rmtree(node.store_dir)
    before = await submit_patiently(nc, job(total_steps=6, checkpoint={"every_steps": 3}))
    await node.start()
    await all_current(nc)
    assert (await finished(nc, before, 120)).state is RunState.COMPLETED
    # Its copies serve: with another node down, it is one of the two that form a majority.
    other = hub.hub.nodes[2]
    await other.kill()
    try:
        later = await submit_patiently(nc, job(total_steps=6, checkpoint={"every_steps": 3}))
        record = await finished(nc, later, 120)
        assert record.state is RunState.COMPLETED, record
        await eventually(
            lambda: _holds(node, names.RUNS_BUCKET, later), 30, "the new run on the wiped node"
        )
    finally:
        await other.start()
    await all_current(nc)


async def test_a_rolling_restart_mid_run_and_the_sites_link_through_each_loss(hub: Stack) -> None:
    """Every node stopped and started in turn while a run trains. With each one down, the
    site's trainer's heartbeats, sent at the site, still reach the hub: the leaf was given
    every node's URL, and its link is on a live node. (A stopped node's sockets close as a
    SIGKILLed one's do, which is all the leaf sees; the leaders' test kills.)"""
    run = await MidRun.start(hub, "rolling", pace=0.12)
    nc = run.nc
    for node in hub.hub.nodes:
        await run.submitter.one_more()
        await node.stop()
        lost_at = time.time()
        print(f"{node.server_name}: stopped")

        async def beating(since: float = lost_at) -> bool:
            try:
                workers = await live_workers(nc.jetstream())
            except Exception:
                return False  # the workers bucket electing its leader
            info = next((w for w in workers if w.worker == SITE_TRAINER), None)
            return info is not None and info.at > since + 1

        await eventually(beating, 60, f"a site heartbeat with {node.server_name} down")
        assert await _leaf_links(hub, node) == 1, "the site's link is on a live node"
        print(f"{node.server_name}: site beat after {time.time() - lost_at:.1f} s")
        await node.start()
        await all_current(nc)
        print(f"{node.server_name}: back and current after {time.time() - lost_at:.1f} s")
    await run.ends_untroubled()


async def test_a_silent_host_is_handed_over_in_seconds_not_the_lease_ttl(hub: Stack) -> None:
    """A hub trainer and its training processes stopped (SIGSTOP: their connections stay
    open, nothing more is sent), as when a host hangs or loses its cable. The reaper hears
    its pulse stop and hands the run over: the next attempt's first step comes within
    `SILENT_HOST_S`, not the lease's 30 s, and the run ends bitwise equal to an
    uninterrupted one. The stopped trainer, woken, finds itself fenced."""
    pool = "hang"  # two trainers of their own: the run stays at the hub
    for name in ("hang-1", "hang-2"):
        await hub.add_trainer(name, env={"BATON_POOL": pool})
    nc = await hub.client()
    want = await reference(nc, MidRun.TOTAL)
    spec = msgspec.structs.replace(charlm(MidRun.TOTAL, 0.05, "silent-host"), pool=pool)
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 30, 60, "step 30")
    assert isinstance(first, Progress)
    async with stop_host(hub, first.worker) as stopped_at:
        again = await log.wait_for(
            lambda e: isinstance(e, Started) and e.worker != first.worker, 60, "the hand-over"
        )
        resumed = await log.wait_for(
            lambda e: isinstance(e, Progress) and e.worker == again.worker, 60, "a step"
        )
    handed = log.of(HandedOver)
    assert len(handed) == 1 and "no pulse" in handed[0].reason, handed
    took = resumed.at - stopped_at
    print(f"silent host -> first resumed step {took:.2f} s ({handed[0].reason})")
    assert took < SILENT_HOST_S, f"{took:.2f} s from the silence to the next attempt's step"
    fenced = await log.wait_for(lambda e: isinstance(e, Fenced), 60, "the woken trainer")
    assert isinstance(fenced, Fenced) and fenced.worker == first.worker
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED and record.digest == want
    log.close()


async def _leaf_links(hub: Stack, down: NatsServer) -> int:
    """Leaf links the hub's live nodes hold, from their monitoring endpoints."""

    def leafs(port: int) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/leafz", timeout=5) as resp:
            return len(json.load(resp).get("leafs") or [])

    ports = [n.http_port for n in hub.hub.nodes if n is not down and n.http_port]
    return sum(await asyncio.gather(*(asyncio.to_thread(leafs, p) for p in ports)))


async def _holds(node: NatsServer, bucket: str, key: str) -> bool:
    """Whether `node`'s own copy of `bucket` has `key`: its store on disk names it (a
    message block holds the subject in the clear)."""
    subject = f"$KV.{bucket}.{key}".encode()
    blocks = Path(node.store_dir).glob(f"**/KV_{bucket}/msgs/*.blk")
    return any(subject in b.read_bytes() for b in blocks)
