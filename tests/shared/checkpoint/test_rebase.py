"""Rollbacks and forks' grafts on real commits, on file:// and S3 (a real SeaweedFS): where
`latest` goes, what is abandoned, what can still be restored, and what garbage collection
may take."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from shared.checkpoint import commit, lineage, rebase, retention
from shared.checkpoint.store import Store, open_store
from shared.contracts import CommitRequest, FileRef, decode
from shared.contracts.checkpoints import Base, Rewound
from shared.contracts.events import Forked, RolledBack
from shared.errors import ContractError, FinalCommitted, IntegrityError, StaleToken
from tests.support.seaweed import SeaweedS3

RUN, FORK = "r1", "r2"
HASH, FORK_HASH = "0123456789abcdef", "fedcba9876543210"
HOUR = 3600.0


@pytest.fixture(params=["file", "s3"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Store]:
    if request.param == "file":
        url = f"file://{tmp_path / 'store'}"
    else:
        seaweed: SeaweedS3 = request.getfixturevalue("seaweed")
        for name, value in seaweed.env().items():
            monkeypatch.setenv(name, value)
        url = seaweed.url(f"t-{uuid.uuid4().hex[:12]}")
    async with open_store(url) as s:
        yield s


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def commit_step(
    store: Store, token: int, step: int, run: str = RUN, *, final: bool = False, meta_of: str = ""
) -> CommitRequest:
    """A checkpoint as a training process writes one: its weights and its meta.json (which
    names `meta_of`, when given, instead of its run)."""
    weights = save({"w": torch.full((4,), float(step) + token / 100)})
    meta = json.dumps(
        {
            "run_id": meta_of or run, "step": step, "spec_hash": HASH, "cursor": {"step": step},
            "state": {},
        },
        sort_keys=True,
    ).encode()  # fmt: skip
    refs = []
    for name, data in (("model.safetensors", weights), ("meta.json", meta)):
        key = commit.data_key(run, token, step, name)
        await store.put_once(key, data)
        refs.append(FileRef(name=name, key=key, size=len(data), sha256=sha(data)))
    req = CommitRequest(
        run_id=run, token=token, step=step, worker="w", files=refs, final=final,
        digest=f"digest-{token}-{step}",
    )  # fmt: skip
    await commit.commit(store, req)
    return req


def rewind_request(token: int, step: int, run: str = RUN) -> CommitRequest:
    return CommitRequest(
        run_id=run, token=token, step=step, worker="w2", files=[],
        base=Base(run_id=run, step=step, reason="bad data"),
    )  # fmt: skip


def graft_request(token: int, step: int, fork: str = FORK, parent: str = RUN) -> CommitRequest:
    return CommitRequest(
        run_id=fork, token=token, step=step, worker="w3", files=[],
        base=Base(run_id=parent, step=step, spec_hash=FORK_HASH),
    )  # fmt: skip


class Clock:
    """The collector's monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def statuses(store: Store, run: str = RUN) -> dict[tuple[int, int], str]:
    return {(s.manifest.token, s.manifest.step): s.status for s in await lineage.stored(store, run)}


async def test_a_rollback_points_latest_at_the_older_checkpoint_and_abandons_the_rest(
    store: Store,
) -> None:
    for step in range(1, 6):
        await commit_step(store, 1, step)
    done = await rebase.rebase(store, rewind_request(2, 2))

    latest = await commit.read_latest(store, RUN)
    assert latest is not None and done.pointer == latest[0], (done, latest)
    assert (latest[0].token, latest[0].step) == (2, 2), latest
    assert latest[0].manifest == commit.manifest_key(RUN, 2, 1), "its files stay where they are"
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is not None and (manifest.token, manifest.step) == (1, 2), manifest
    assert damaged == [], damaged
    seen = await statuses(store)
    assert seen == {
        (1, 5): "abandoned", (1, 4): "abandoned", (1, 3): "abandoned",
        (1, 2): "chain", (1, 1): "chain",
    }, seen  # fmt: skip
    event = done.event()
    assert isinstance(event, RolledBack), event
    assert (event.from_step, event.to_step, event.abandoned) == (5, 2, [5, 4, 3]), event
    assert event.token == 2 and event.reason == "bad data", event
    (note,) = await retention.rewinds(store, RUN)
    assert note == done.rewound, (note, done.rewound)

    # The run goes on from there: its next commit's `previous` is the step it went back to.
    await commit_step(store, 2, 3)
    chain = await retention.committed_chain(store, RUN)
    assert [(m.token, m.step) for m in chain] == [(2, 3), (1, 2), (1, 1)], chain
    seen = await statuses(store)
    assert seen[(1, 3)] == "abandoned" and seen[(2, 3)] == "chain", seen


async def test_a_redelivered_rollback_does_nothing_twice(store: Store) -> None:
    for step in range(1, 4):
        await commit_step(store, 1, step)
    first = await rebase.rebase(store, rewind_request(2, 1))
    again = await rebase.rebase(store, rewind_request(2, 1))
    assert again == first, (first, again)
    assert len(await retention.rewinds(store, RUN)) == 1


async def test_a_zombie_can_neither_rewind_nor_commit_past_a_rollback(store: Store) -> None:
    for step in range(1, 5):
        await commit_step(store, 3, step)
    # The attempt that trained past the step cannot rewind under its own token.
    with pytest.raises(StaleToken):
        await rebase.rebase(store, rewind_request(3, 2))
    await rebase.rebase(store, rewind_request(4, 2))
    # Its late commits (any step, a lower token) are refused by the pointer's order.
    with pytest.raises(StaleToken):
        await commit_step(store, 3, 9)
    # And an older rollback, arriving late, cannot move it back again.
    with pytest.raises(StaleToken):
        await rebase.rebase(store, rewind_request(2, 1))
    latest = await commit.read_latest(store, RUN)
    assert latest is not None and (latest[0].token, latest[0].step) == (4, 2), latest


async def test_a_rollback_needs_a_committed_checkpoint_on_the_chain_that_verifies(
    store: Store,
) -> None:
    with pytest.raises(IntegrityError, match="no committed checkpoint"):
        await rebase.rebase(store, rewind_request(2, 1))
    for step in (10, 20, 30):
        await commit_step(store, 1, step)
    with pytest.raises(IntegrityError, match="no committed checkpoint at step 15"):
        await rebase.rebase(store, rewind_request(2, 15))
    await store.delete(commit.data_key(RUN, 1, 20, "model.safetensors"))
    with pytest.raises(IntegrityError, match="damaged"):
        await rebase.rebase(store, rewind_request(2, 20))
    await rebase.rebase(store, rewind_request(2, 10))
    # Step 30 is abandoned now: it can be forked from, not rolled back to.
    with pytest.raises(IntegrityError, match="abandoned by a rollback"):
        await rebase.rebase(store, rewind_request(3, 30))
    latest = await commit.read_latest(store, RUN)
    assert latest is not None and (latest[0].token, latest[0].step) == (2, 10), latest
    with pytest.raises(ContractError):
        bad = CommitRequest(
            run_id=RUN, token=5, step=3, worker="w", files=[], base=Base(run_id=RUN, step=10)
        )
        await rebase.rebase(store, bad)


async def test_restore_never_walks_onto_an_abandoned_checkpoint(store: Store) -> None:
    for step in range(1, 6):
        await commit_step(store, 1, step)
    await rebase.rebase(store, rewind_request(2, 3))
    # The step gone back to is damaged after the rollback: the walk goes further back,
    # never forward onto the newer, abandoned checkpoints.
    await store.delete(commit.data_key(RUN, 1, 3, "model.safetensors"))
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is not None and manifest.step == 2 and damaged == [3], (manifest, damaged)


async def test_a_final_checkpoint_is_never_rewound(store: Store) -> None:
    """A run trained to the end is forked, never rolled back: the store refuses it."""
    for step in range(1, 5):
        await commit_step(store, 1, step)
    await commit_step(store, 1, 5, final=True)
    before = await commit.read_latest(store, RUN)
    with pytest.raises(FinalCommitted):
        await rebase.rebase(store, rewind_request(2, 2))
    assert await commit.read_latest(store, RUN) == before


async def test_garbage_collection_takes_abandoned_checkpoints_but_no_chain(
    store: Store,
) -> None:
    for step in range(1, 6):
        await commit_step(store, 1, step)
    await retention.pin(store, RUN, 4)
    await rebase.rebase(store, rewind_request(2, 2))
    await commit_step(store, 2, 3)
    clock = Clock()
    seen = retention.Sightings(clock)
    assert await retention.collect_garbage(store, RUN, HOUR, seen) == []  # not old yet
    clock.now += 2 * HOUR
    deleted = await retention.collect_garbage(store, RUN, HOUR, seen)
    gone = {(commit.step_of(k), k.split("/")[3]) for k in deleted if "/manifests/" in k}
    assert {s for s, _ in gone} == {3, 5}, deleted  # 4 is pinned; 5 was abandoned
    listed = await statuses(store)
    assert listed == {(2, 3): "chain", (1, 4): "abandoned", (1, 2): "chain", (1, 1): "chain"}, (
        listed
    )
    manifest, _ = await commit.restorable(store, RUN)
    assert manifest is not None and (manifest.token, manifest.step) == (2, 3), manifest
    # Retention counts from the new head: the step gone back to is kept while it is wanted.
    assert await retention.apply_retention(store, RUN, 2, set()) == [1]
    assert [m.step for m in await retention.committed_chain(store, RUN)] == [3, 2]


async def test_a_graft_copies_the_parents_checkpoint_into_the_forks_own_prefix(
    store: Store,
) -> None:
    for step in (10, 20, 30):
        await commit_step(store, 1, step)
    parent = await lineage.find(store, RUN, 20)
    done = await rebase.rebase(store, graft_request(7, 20))

    latest = await commit.read_latest(store, FORK)
    assert latest is not None and latest[0] == done.pointer, (latest, done)
    assert (latest[0].token, latest[0].step) == (7, 20), latest
    manifest, _ = await commit.restorable(store, FORK)
    assert manifest is not None and manifest.run_id == FORK, manifest
    assert manifest.grafted_from == parent.key and manifest.previous is None, manifest
    assert manifest.digest == parent.manifest.digest == "digest-1-20", manifest
    assert all(f.key.startswith(f"runs/{FORK}/data/000000000007/") for f in manifest.files)
    theirs = {f.name: f for f in parent.manifest.files}
    ours = {f.name: f for f in manifest.files}
    weights = await store.get(theirs["model.safetensors"].key)
    assert ours["model.safetensors"].sha256 == theirs["model.safetensors"].sha256, ours
    meta = json.loads(await store.get(ours["meta.json"].key))
    assert (meta["run_id"], meta["spec_hash"]) == (FORK, FORK_HASH), meta
    assert meta["forked_from"] == {"run_id": RUN, "step": 20, "spec_hash": HASH}, meta
    assert meta["cursor"] == {"step": 20}, "the rest of what it held is the parent's"
    event = done.event()
    assert isinstance(event, Forked) and (event.parent, event.step) == (RUN, 20), event
    assert await rebase.rebase(store, graft_request(7, 20)) == done, "a redelivery"

    # Nothing the parent's retention does reaches the fork's base.
    assert await retention.apply_retention(store, RUN, 1, set()) == [20, 10]
    assert await retention.collect_garbage(store, RUN, 0.0) == []
    manifest, damaged = await commit.restorable(store, FORK)
    assert manifest is not None and manifest.step == 20 and damaged == [], (manifest, damaged)
    assert await store.get(ours["model.safetensors"].key) == weights


async def test_a_fork_may_start_from_an_abandoned_checkpoint(store: Store) -> None:
    for step in (1, 2, 3):
        await commit_step(store, 1, step)
    await rebase.rebase(store, rewind_request(2, 1))
    done = await rebase.rebase(store, graft_request(5, 3))
    assert done.grafted is not None and done.grafted.step == 3, done
    assert done.grafted.grafted_from == commit.manifest_key(RUN, 3, 1), done


async def test_a_graft_is_refused_where_it_cannot_apply(store: Store) -> None:
    await commit_step(store, 1, 10)
    with pytest.raises(IntegrityError, match="no committed checkpoint at step 20"):
        await rebase.rebase(store, graft_request(3, 20))
    # A submitter's fork may start only from that submitter's runs.
    with pytest.raises(IntegrityError, match="forks its own"):
        await rebase.rebase(store, graft_request(3, 10, fork="alice.r9"))
    await commit_step(store, 1, 10, run="alice.r8")
    assert (await rebase.rebase(store, graft_request(3, 10, "alice.r9", "alice.r8"))).grafted
    # Only into a run with no checkpoint of its own.
    await commit_step(store, 2, 5, run=FORK)
    with pytest.raises(StaleToken, match="has a checkpoint already"):
        await rebase.rebase(store, graft_request(3, 10))
    # A parent's meta.json that names another run is not adopted.
    await commit_step(store, 4, 30, run="r7", meta_of="r5")
    with pytest.raises(IntegrityError, match="not run r7's at step 30"):
        await rebase.rebase(store, graft_request(2, 30, fork="r6", parent="r7"))
    assert await commit.read_latest(store, "r6") is None


async def test_notes_decode(store: Store) -> None:
    for step in (1, 2):
        await commit_step(store, 1, step)
    await rebase.rebase(store, rewind_request(2, 1))
    (key,) = await store.list(commit.rewinds_prefix(RUN))
    note = decode(await store.get(key), Rewound)
    assert key == commit.rewind_key(RUN, 2, 1, 2), key
    assert note.abandoned == [commit.manifest_key(RUN, 2, 1)], note


async def test_a_run_does_not_go_back_to_its_final_checkpoint(store: Store) -> None:
    await commit_step(store, 1, 10)
    await commit_step(store, 1, 20, final=True)
    for step in (20, 10):  # a final checkpoint is terminal for the store
        with pytest.raises(FinalCommitted):
            await rebase.rebase(store, rewind_request(2, step))
    # A fork may start from it (with more steps to train: its own spec says so).
    assert (await rebase.rebase(store, graft_request(3, 20))).pointer.step == 20
