"""Job specs and helpers shared by the end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from baton.client import calls as client
from shared.bus import names
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import CommitRequest, FileRef, JobSpec, RunRecord, convert, encode
from shared.contracts import events as ev
from shared.contracts.events import Event
from shared.state.runs import Runs
from tests.support.stack import all_dead, eventually

E = TypeVar("E")


def job(**over: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "e2e",
        "entry_point": "examples.regression:train",
        "total_steps": 120,
        "seed": 3,
        "deterministic": True,
        "checkpoint": {"every_steps": 20},
        "config": {"hidden": 32, "batch": 32},
        "idempotency_key": uuid.uuid4().hex,
    }
    base.update(over)
    return convert(base, JobSpec)


def charlm(total: int, pace: float, *, name: str, seed: int, every: int) -> JobSpec:
    """examples/charlm.py, small (a user's code: a shuffling data loader that keeps its
    position across a resume, AdamW, a cosine schedule); `pace` changes no arithmetic."""
    return job(
        name=name, entry_point="examples.charlm:train", total_steps=total, seed=seed,
        checkpoint={"every_steps": every},
        config={"data": "baton", "num_workers": 1, "hidden": 64, "pace": pace},
    )  # fmt: skip


def paced(total: int, pace: float = 0.05, **over: Any) -> JobSpec:
    """The paced regression (`tests.support.workloads:paced`), a checkpoint every 10 steps
    (unless `over` says otherwise): slow enough that a test can cut a link or kill a process
    mid-run."""
    return job(
        **{
            "entry_point": "tests.support.workloads:paced", "total_steps": total,
            "checkpoint": {"every_steps": 10}, "config": {"pace": pace}, "seed": 11, **over,
        }
    )  # fmt: skip


async def submit(nc: Client, spec: JobSpec) -> str:
    run_id, answer = await client.submit(nc, spec, 10)
    assert answer is not None and type(answer).__name__ == "Accepted", answer
    return run_id


async def finished(nc: Client, run_id: str, timeout: float = 90) -> RunRecord:
    """The run's record once it is terminal. A clustered hub electing a leader may leave a
    read unanswered for a moment: that read is tried again, within `timeout`."""
    runs: Runs | None = None

    async def terminal() -> RunRecord | None:
        nonlocal runs
        try:
            runs = runs or await Runs.open(nc.jetstream())
            found = await runs.get(run_id)
        except (NatsTimeoutError, NoRespondersError, ServiceUnavailableError):
            return None
        return found[0] if found and found[0].state.terminal else None

    return await eventually(terminal, timeout, f"run {run_id} to finish", every=0.2)


async def history(nc: Client, run_id: str) -> list[Event]:
    return await client.history(nc, run_id)


class EventLog:
    """Collects a run's events in the background; tests wait on conditions over them."""

    def __init__(self, nc: Client, run_id: str) -> None:
        self.nc = nc
        self.run_id = run_id
        self.events: list[Event] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for event in client.events(self.nc, self.run_id):
            self.events.append(event)
            self._changed.set()

    async def wait_for(self, pred: Callable[[Event], bool], timeout: float, what: str) -> Event:
        deadline = asyncio.get_running_loop().time() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if pred(event):
                    return event
            seen = len(self.events)
            self._changed.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {what}; saw {[type(e).__name__ for e in self.events]}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def of(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]

    def close(self) -> None:
        self._task.cancel()


async def replay_commit(
    nc: Client, store_url: str, run_id: str, epoch: int, worker: str, ranks: int
) -> int:
    """Commit again the newest complete checkpoint an old group (`epoch`) wrote, as a zombie
    would after a newer group committed; returns its step. The store must refuse it."""
    async with open_store(store_url) as store:
        prefix = f"runs/{run_id}/data/{epoch:012d}/"
        mine = await store.list(prefix)
        late = max(int(k.split("/")[4]) for k in mine)
        files = []
        for key in (k for k in mine if int(k.split("/")[4]) == late):
            size, digest = await store.stat(key)
            files.append(FileRef(name=key.rsplit("/", 1)[1], key=key, size=size, sha256=digest))
        latest = await commit.read_latest(store, run_id)
        assert latest is not None and latest[0].token > epoch, "no newer group committed yet"
    req = CommitRequest(
        run_id=run_id, token=epoch, step=late, worker=worker, files=files, ranks=ranks
    )
    await nc.jetstream().publish(names.commit_subject(run_id), encode(req))
    return late


async def fenced_and_refused(
    log: EventLog, store_url: str, zombie: str, epoch: int, family: list[int], ranks: int
) -> None:
    """A leader of the group `epoch`, stopped past its TTL while a newer group committed, let
    go again: it is fenced with its epoch, its training process is gone, and its newest
    complete checkpoint, committed again, is refused by the store."""
    fenced = await log.wait_for(
        lambda e: isinstance(e, ev.Fenced) and e.worker == zombie, 30, "the zombie to notice"
    )
    assert isinstance(fenced, ev.Fenced) and fenced.token == epoch
    await all_dead(family, "the zombie's training process")
    late = await replay_commit(log.nc, store_url, log.run_id, epoch, zombie, ranks)
    await log.wait_for(
        lambda e: isinstance(e, ev.CommitRefused) and e.token == epoch and e.step == late,
        30,
        "the refusal",
    )
