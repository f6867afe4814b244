"""Retention and garbage collection on real commits, on file:// and S3 (a real SeaweedFS)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from shared.checkpoint import commit, retention
from shared.checkpoint.store import Store, open_store
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, FileRef, Manifest, encode
from shared.errors import FinalCommitted, StaleToken
from tests.support.seaweed import SeaweedS3

RUN = "r1"
FILES = ("model.safetensors", "meta.json")
HOUR = 3600.0


class Clock:
    """The collector's monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def seen_long_ago(store: Store, hours: float = 10) -> retention.Sightings:
    """Sightings of everything in the store now, `hours` old: a collector that has watched
    the run that long (its first pass only looks; nothing is old to it yet)."""
    clock = Clock()
    seen = retention.Sightings(clock)
    assert await retention.collect_garbage(store, RUN, HOUR, seen) == []
    clock.now += hours * HOUR
    return seen


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


async def upload(store: Store, token: int, step: int, *, final: bool = False) -> CommitRequest:
    """What a trainer does before it asks for a commit: write-once files, with digests."""
    refs = []
    for name in FILES:
        data = f"{name} of token {token} step {step}".encode()
        if name.endswith(".safetensors"):  # commit checks safetensors headers
            data = save({"text": torch.frombuffer(bytearray(data), dtype=torch.uint8)})
        key = commit.data_key(RUN, token, step, name)
        await store.put_once(key, data)
        refs.append(
            FileRef(name=name, key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        )
    return CommitRequest(run_id=RUN, token=token, step=step, worker="w", files=refs, final=final)


async def commit_steps(
    store: Store, token: int, steps: range, *, final: set[int] | None = None
) -> None:
    for step in steps:
        await commit.commit(store, await upload(store, token, step, final=step in (final or ())))


def keys_of(token: int, step: int) -> set[str]:
    files = {commit.data_key(RUN, token, step, name) for name in FILES}
    return files | {commit.manifest_key(RUN, step, token)}


async def stored(store: Store) -> set[str]:
    return set(await store.list(f"runs/{RUN}/data/")) | set(
        await store.list(f"runs/{RUN}/manifests/")
    )


async def chain_steps(store: Store) -> list[int]:
    return [m.step for m in await retention.committed_chain(store, RUN)]


async def ten_commits(store: Store) -> None:
    """Steps 1..10, a takeover between steps 5 and 6, the last one final."""
    await commit_steps(store, 1, range(1, 6))
    await commit_steps(store, 2, range(6, 11), final={10})


TOKEN_OF = {step: 1 if step <= 5 else 2 for step in range(1, 11)}


def keys_of_steps(steps: set[int]) -> set[str]:
    return set().union(*(keys_of(TOKEN_OF[s], s) for s in steps))


# -- retention -----------------------------------------------------------------------------


async def test_retention_keeps_the_newest_the_pinned_and_the_final(store: Store) -> None:
    await ten_commits(store)
    assert await chain_steps(store) == list(range(10, 0, -1))
    await retention.pin(store, RUN, 2)
    await retention.pin(store, RUN, 2)  # pinning twice is no error
    assert await retention.pins(store, RUN) == {2}

    removed = await retention.apply_retention(store, RUN, 3, await retention.pins(store, RUN))
    assert removed == [7, 6, 5, 4, 3, 1], removed
    left = await stored(store)
    assert left == keys_of_steps({10, 9, 8, 2}), sorted(left)
    # The chain now ends where retention cut it; the pinned step lies behind the cut.
    assert await chain_steps(store) == [10, 9, 8]
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is not None and manifest.step == 10 and damaged == [], (manifest, damaged)

    # Idempotent: the second pass finds nothing to do, and garbage collection, even with
    # every object long past its grace period, takes nothing committed or pinned.
    assert await retention.apply_retention(store, RUN, 3, {2}) == []
    assert await retention.collect_garbage(store, RUN, HOUR, await seen_long_ago(store)) == []
    assert await stored(store) == keys_of_steps({10, 9, 8, 2})


async def test_a_final_checkpoint_ends_the_chain_and_is_kept(store: Store) -> None:
    """A final checkpoint is terminal for the store (nothing is committed after it, from any
    token), and retention keeps it with the `keep_last` before it."""
    await commit_steps(store, 1, range(1, 7), final={6})
    with pytest.raises(FinalCommitted):
        await commit_steps(store, 2, range(7, 8))
    assert await retention.apply_retention(store, RUN, 2, set()) == [4, 3, 2, 1]
    kept = keys_of(1, 6) | keys_of(1, 5) | keys_of(2, 7) - {commit.manifest_key(RUN, 7, 2)}
    assert await stored(store) == kept
    assert await retention.collect_garbage(store, RUN, HOUR, await seen_long_ago(store)) == []
    assert await stored(store) == kept, "garbage collection keeps the final chain"
    assert await retention.collect_garbage(store, RUN, HOUR, await seen_long_ago(store)) == []
    assert await stored(store) == kept


async def test_the_checkpoint_latest_names_is_always_kept(store: Store) -> None:
    await commit_steps(store, 1, range(1, 4))
    with pytest.raises(ValueError):
        await retention.apply_retention(store, RUN, -1, set())
    assert await retention.apply_retention(store, RUN, 0, set()) == [2, 1]
    assert await stored(store) == keys_of(1, 3)
    manifest, _ = await commit.restorable(store, RUN)
    assert manifest is not None and manifest.step == 3


async def test_an_empty_run_has_nothing_to_keep_or_collect(store: Store) -> None:
    assert await retention.committed_chain(store, RUN) == []
    assert await retention.pins(store, RUN) == set()
    assert await retention.apply_retention(store, RUN, 3, set()) == []
    assert await retention.collect_garbage(store, RUN, 0) == []
    with pytest.raises(ValueError):
        await retention.collect_garbage(store, RUN, HOUR)  # an age needs sightings
    with pytest.raises(ValueError):
        await retention.collect_garbage(store, RUN, -1, retention.Sightings())


async def test_concurrent_retention_and_collection_agree(store: Store) -> None:
    await ten_commits(store)
    far = await seen_long_ago(store)
    # Step 2 is pinned only by the argument: retention must record the pin before it cuts
    # the chain above step 2, or the collectors racing it would take step 2 as garbage.
    results = await asyncio.gather(
        *(retention.apply_retention(store, RUN, 3, {2}) for _ in range(4)),
        *(retention.collect_garbage(store, RUN, HOUR, far) for _ in range(2)),
    )
    removed = set().union(*results[:4])
    assert removed == {7, 6, 5, 4, 3, 1}, results
    left = await stored(store)
    assert left == keys_of_steps({10, 9, 8, 2}), sorted(left ^ keys_of_steps({10, 9, 8, 2}))
    assert await retention.pins(store, RUN) == {2}
    manifest, _ = await commit.restorable(store, RUN)
    assert manifest is not None and manifest.step == 10


async def test_retention_after_each_commit_keeps_a_sliding_window(store: Store) -> None:
    # How the checkpointer uses it: right after every successful pointer CAS.
    for step in range(1, 8):
        await commit.commit(store, await upload(store, 1, step))
        await retention.apply_retention(store, RUN, 2, {3})
    assert await stored(store) == keys_of(1, 7) | keys_of(1, 6) | keys_of(1, 3)
    assert await chain_steps(store) == [7, 6]


# -- garbage collection --------------------------------------------------------------------


async def zombie_manifest(store: Store, req: CommitRequest) -> str:
    """A fenced worker's manifest: written before it lost the pointer CAS, never committed."""
    key = commit.manifest_key(RUN, req.step, req.token)
    manifest = Manifest(
        run_id=RUN,
        token=req.token,
        step=req.step,
        worker="zombie",
        files=req.files,
        final=False,
        metrics={},
        digest="",
        previous=None,
        created_at=time.time(),
    )
    await store.put_once(key, encode(manifest))
    return key


async def test_collection_takes_only_what_no_commit_can_adopt(store: Store) -> None:
    await commit_steps(store, 2, range(1, 4))
    committed = await stored(store)
    # A zombie (token 1) uploaded step 4 and wrote its manifest; its commit is refused.
    zombie = await upload(store, 1, 4)
    with pytest.raises(StaleToken):
        await commit.commit(store, zombie)
    await zombie_manifest(store, zombie)
    # A crashed upload below latest, a stray object no commit names, and an upload above
    # latest whose commit is still queued.
    crashed = commit.data_key(RUN, 2, 2, "optimizer.safetensors")
    await store.put_once(crashed, b"half")
    await store.put_once(f"runs/{RUN}/data/stray.bin", b"?")
    pending = await upload(store, 2, 4)
    garbage = keys_of(1, 4) | {crashed, f"runs/{RUN}/data/stray.bin"}

    # Everything is younger than the grace period: nothing goes.
    clock = Clock()
    seen = retention.Sightings(clock)
    young = await retention.collect_garbage(store, RUN, HOUR, seen)
    assert young == [], young
    clock.now += 2 * HOUR
    removed = await retention.collect_garbage(store, RUN, HOUR, seen)
    assert removed == sorted(garbage), removed
    left = await stored(store)
    assert left == committed | {f.key for f in pending.files}, sorted(left)
    assert await retention.collect_garbage(store, RUN, HOUR, seen) == []
    assert len(seen) == 0, "what is gone is forgotten"

    # The queued commit still lands on the files collection left alone.
    pointer, _ = await commit.commit(store, pending)
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is not None and (manifest.token, manifest.step) == (2, 4), manifest
    assert pointer.step == 4 and damaged == []


async def test_collection_judges_each_object_by_how_long_it_has_been_seen(store: Store) -> None:
    await commit_steps(store, 2, range(1, 3))
    committed = await stored(store)
    clock = Clock()
    seen = retention.Sightings(clock)
    old_zombie = await upload(store, 1, 3)
    assert await retention.collect_garbage(store, RUN, HOUR, seen) == []
    clock.now += HOUR / 2
    new_zombie = await upload(store, 1, 4)
    assert await retention.collect_garbage(store, RUN, HOUR, seen) == []
    clock.now += HOUR / 2
    removed = await retention.collect_garbage(store, RUN, HOUR, seen)
    assert removed == sorted(f.key for f in old_zombie.files), removed
    assert await stored(store) == committed | {f.key for f in new_zombie.files}
    clock.now += HOUR / 2
    removed = await retention.collect_garbage(store, RUN, HOUR, seen)
    assert removed == sorted(f.key for f in new_zombie.files), removed
    assert await stored(store) == committed


async def test_an_uploaders_clock_does_not_age_its_objects(tmp_path: Path) -> None:
    """A file store's last-modified is whatever clock the uploading trainer's `utime` read:
    one hours behind makes its fresh upload look old, one ahead makes it look young for
    ever. Neither is read: an object is as old as the collector has seen it."""
    store = FileStore(tmp_path)
    await commit_steps(store, 2, range(1, 3))
    committed = await stored(store)
    behind, ahead = await upload(store, 1, 3), await upload(store, 1, 4)
    for req, shift in ((behind, -10 * HOUR), (ahead, 10 * HOUR)):
        for f in req.files:
            at = time.time() + shift
            os.utime(tmp_path / f.key, (at, at))
    clock = Clock()
    seen = retention.Sightings(clock)
    assert await retention.collect_garbage(store, RUN, HOUR, seen) == [], "fresh to us"
    clock.now += HOUR
    removed = await retention.collect_garbage(store, RUN, HOUR, seen)
    assert removed == sorted(f.key for f in behind.files + ahead.files), removed
    assert await stored(store) == committed


# -- restore after retention and collection -----------------------------------------------


async def damage_latest(store: Store, how_many: int) -> None:
    """Remove a file of each of the newest `how_many` checkpoints, as a disk or an operator
    might after their commit (write-once keys cannot be overwritten, on either backend)."""
    for manifest in (await retention.committed_chain(store, RUN))[:how_many]:
        await store.delete(manifest.files[0].key)


async def test_restore_walks_back_to_the_previous_retained_checkpoint(store: Store) -> None:
    await ten_commits(store)
    await retention.apply_retention(store, RUN, 3, {2})
    await retention.collect_garbage(store, RUN, HOUR, await seen_long_ago(store))
    await damage_latest(store, 1)
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is not None and manifest.step == 9 and damaged == [10], (manifest, damaged)


async def test_restore_stops_at_the_cut_rather_than_jumping_to_a_pin(store: Store) -> None:
    # Defined behaviour: the walk follows `previous` only. When every retained checkpoint
    # is damaged, restore reports none, even though pinned step 2 is intact behind the cut.
    await ten_commits(store)
    await retention.apply_retention(store, RUN, 3, {2})
    await damage_latest(store, 3)
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is None and damaged == [10, 9, 8], (manifest, damaged)
    assert await stored(store) >= keys_of(1, 2)


async def test_with_one_kept_a_damaged_latest_leaves_nothing_to_restore(store: Store) -> None:
    await commit_steps(store, 1, range(1, 5))
    await retention.apply_retention(store, RUN, 1, set())
    await damage_latest(store, 1)
    assert await commit.restorable(store, RUN) == (None, [4])
