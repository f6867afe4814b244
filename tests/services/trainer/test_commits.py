"""`Commits.wait`, against a real nats-server and file store: it learns a commit's outcome
from the checkpointer's event, and falls back to the store — the truth — when no event
comes (one published while the link was down never reaches a core subscription)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

from nats.aio.client import Client

from services.trainer.commits import Commits
from shared.bus import names
from shared.bus.emit import emit
from shared.checkpoint import commit
from shared.checkpoint.store import Store, open_store
from shared.contracts import (
    CommitRequest,
    FileRef,
    JobSpec,
    RunRecord,
    RunState,
    convert,
    spec_hash,
)
from shared.contracts.child import CheckpointReady
from shared.contracts.events import CheckpointCommitted, CommitRefused
from shared.state.runs import Runs
from tests.support.stack import eventually

RUN = "rcommits"
TOKEN = 5
SPEC = convert({"name": "c", "entry_point": "m:f", "total_steps": 100}, JobSpec)
LONG_S = 30.0
"""A wait's timeout where the answer must come from the store or an event, not the clock."""
BOUND_S = 15.0
"""How long the test lets such a wait take: well under `LONG_S`, so a wait that only
ended by timing out fails the test."""


async def files(store: Store, token: int, step: int) -> list[FileRef]:
    key = commit.data_key(RUN, token, step, "meta.json")
    data = f'{{"step": {step}}}'.encode()
    await store.put_once(key, data)
    digest = hashlib.sha256(data).hexdigest()
    return [FileRef(name="meta.json", key=key, size=len(data), sha256=digest)]


async def committed(store: Store, token: int, step: int) -> None:
    """A checkpoint committed straight through the protocol: no checkpointer, no event."""
    refs = await files(store, token, step)
    req = CommitRequest(run_id=RUN, token=token, step=step, worker="w", files=refs)
    await commit.commit(store, req)


async def setup(nc: Client, tmp_path: Path) -> tuple[Commits, Store, Runs]:
    js = nc.jetstream()
    runs = await Runs.open(js)
    now = time.time()
    record = RunRecord(
        run_id=RUN, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=RunState.RUNNING, worker="w", token=TOKEN, attempts=1,
    )  # fmt: skip
    assert await runs.create(record)
    store = open_store(f"file://{tmp_path / 'store'}")
    return Commits(js, store, runs, RUN, "w", lambda: TOKEN, keep_last=3), store, runs


async def test_a_commit_heard_of_only_through_the_store_counts(
    declared: Client, tmp_path: Path
) -> None:
    commits, store, _ = await setup(declared, tmp_path)
    try:
        await committed(store, TOKEN, 10)
        ok = await asyncio.wait_for(commits.wait(TOKEN, 10, LONG_S), BOUND_S)
        assert ok is True, "the store says step 10 of this token is committed"
    finally:
        commits.close()
        await store.close()


async def test_a_pointer_with_a_higher_token_means_superseded(
    declared: Client, tmp_path: Path
) -> None:
    commits, store, _ = await setup(declared, tmp_path)
    try:
        await committed(store, TOKEN + 2, 3)  # another worker took over, even at a lower step
        ok = await asyncio.wait_for(commits.wait(TOKEN, 10, LONG_S), BOUND_S)
        assert ok is False, "a higher token's pointer means ours can never be committed"
    finally:
        commits.close()
        await store.close()


async def test_nothing_at_all_is_false_after_the_timeout(declared: Client, tmp_path: Path) -> None:
    commits, store, _ = await setup(declared, tmp_path)
    try:
        assert await commits.wait(TOKEN, 10, 0.5) is False, "no event, no pointer"
    finally:
        commits.close()
        await store.close()


async def test_the_checkpointers_events_settle_a_wait_and_advance_the_record(
    declared: Client, tmp_path: Path
) -> None:
    nc = declared
    commits, store, runs = await setup(nc, tmp_path)
    sub = await nc.subscribe(names.events_of_run(RUN), cb=commits.on_event)
    try:
        refs = await files(store, TOKEN, 10)
        for step in (10, 20):  # requested, as the attempt does before anything is known
            ready = CheckpointReady(step=step, token=TOKEN, files=refs, final=False, digest="")
            await commits.request(ready)
        js = nc.jetstream()
        # The store holds no pointer at all: only the events can decide these waits.
        ok = CheckpointCommitted(run_id=RUN, step=10, token=TOKEN, manifest="m", bytes=1)
        no = CommitRefused(run_id=RUN, step=20, token=TOKEN, reason="damaged")
        await emit(js, ok)
        await emit(js, no)
        assert await asyncio.wait_for(commits.wait(TOKEN, 10, LONG_S), BOUND_S) is True
        assert await asyncio.wait_for(commits.wait(TOKEN, 20, LONG_S), BOUND_S) is False
        assert await commit.read_latest(store, RUN) is None

        async def advanced() -> bool:  # the record's step follows a commit of its token
            found = await runs.get(RUN)
            return found is not None and found[0].step == 10

        await eventually(advanced, BOUND_S, "the record's step to follow the commit")
    finally:
        await sub.unsubscribe()
        commits.close()
        await store.close()
