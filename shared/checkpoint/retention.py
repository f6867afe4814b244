"""Checkpoint retention and garbage collection, on top of any `Store`.

Two jobs with different safety arguments:

* **Retention** (`apply_retention`) drops *committed* checkpoints that are no longer wanted:
  everything in the chain behind `latest` except the newest `keep_last`, pinned steps and
  final checkpoints. It only follows the chain, so it never touches anything uncommitted.
* **Garbage collection** (`collect_garbage`) drops objects that never became part of a
  checkpoint: a fenced zombie's files and manifest, an upload that crashed. It deletes an
  object only when no commit can ever adopt it — its (token, step) is below the one
  `latest` names, and `latest` only grows — and it is older than a grace period as well.
  That age is how long the collector has seen the object (`Sightings`, on its own monotonic
  clock), never an object's last-modified time against the collector's clock: that time is
  the writer's (a file store's `utime` is the uploading trainer's clock) or the store's
  (S3's), and a trainer minutes off would make a fresh upload look old, or an old one young.
  A collector that restarts sees everything anew, so garbage waits one more grace period;
  retiring a run collects its garbage whatever its age (`older_than_s` 0).

Retention deletes a checkpoint's manifest, so afterwards the chain ends where it cut:
`previous` of the oldest retained checkpoint names a manifest that is gone, and walks
(`committed_chain`, `shared.checkpoint.commit.restorable`) stop there. A pinned or final checkpoint
older than such a cut is no longer reachable from `latest`; garbage collection therefore
protects pinned steps and final manifests explicitly instead of relying on the chain.

A rollback (`shared.checkpoint.rebase`) moves `latest` back to an older checkpoint of the
chain: the checkpoints after it leave the chain, are named in the rollback's note
(`abandoned`), and are garbage once old enough, like a zombie's — a final one too; only a pin
keeps one. Every checkpoint on the new chain, its head first, is kept as before.

Deleting an absent key is not an error on any backend, so every function here is
idempotent and two copies may run at once: they can only agree on what to delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable

from shared.checkpoint.commit import (
    load_manifest,
    manifest_key,
    read_latest,
    rewinds_prefix,
    witness_key,
)
from shared.checkpoint.store import Store
from shared.contracts import Manifest, Pointer, decode
from shared.contracts.checkpoints import Rewound
from shared.errors import AlreadyExists, ContractError, NotFound

log = logging.getLogger("baton.retention")

_DATA = re.compile(r"data/(\d{12})/(\d{12})/[^/]+")
_MANIFEST = re.compile(r"manifests/(\d{12})-(\d{12})\.json")
_PIN = re.compile(r"\d{12}")

Checkpoint = tuple[int, int]
"""(token, step): the identity of a checkpoint, and the order `latest` advances in."""


def _run_prefix(run_id: str) -> str:
    return f"runs/{run_id}/"  # the layout of `shared.checkpoint.commit`


def pin_key(run_id: str, step: int) -> str:
    return f"{_run_prefix(run_id)}pins/{step:012d}"


async def pin(store: Store, run_id: str, step: int) -> None:
    """Keep every checkpoint of `step` through retention and garbage collection.

    A pin protects from the retention passes that start after this returns; one already
    running may have decided on the step before it saw the pin. Pins are never removed."""
    with contextlib.suppress(AlreadyExists):  # pinned before: the marker is all there is
        await store.put_once(pin_key(run_id, step), b"")


async def pins(store: Store, run_id: str) -> set[int]:
    prefix = f"{_run_prefix(run_id)}pins/"
    steps = set()
    for key in await store.list(prefix):
        name = key.removeprefix(prefix)
        if _PIN.fullmatch(name):
            steps.add(int(name))
    return steps


async def rewinds(store: Store, run_id: str, token: int | None = None) -> list[Rewound]:
    """The run's rollback notes (`shared.checkpoint.rebase`; those written under `token`
    alone, if given), oldest first. One that does not decode is skipped: a note only marks
    checkpoints that left the chain, and losing one only keeps them longer."""
    notes = []
    for key in await store.list(rewinds_prefix(run_id, token)):
        try:
            notes.append(decode(await store.get(key), Rewound))
        except NotFound:
            continue
        except ContractError:
            log.warning("%s does not decode; ignored", key)
    return notes


async def abandoned(store: Store, run_id: str) -> set[str]:
    """Manifest keys of the checkpoints a rollback took off the chain. Those still off it
    are never restored, and garbage collection takes them, final ones too, once old enough;
    one a later rollback put back on the chain is kept as any on it is."""
    return {key for note in await rewinds(store, run_id) for key in note.abandoned}


async def committed_chain(store: Store, run_id: str) -> list[Manifest]:
    """The committed checkpoints reachable from `latest`, newest first."""
    current = await read_latest(store, run_id)
    return await _walk(store, current[0].checkpoint if current else None)


async def _walk(store: Store, key: str | None) -> list[Manifest]:
    chain: list[Manifest] = []
    seen: set[str] = set()
    # `previous` links strictly descend in (token, step), so a cycle means a forged
    # manifest; the set keeps one from turning a walk into an endless loop.
    while key is not None and key not in seen:
        seen.add(key)
        try:
            manifest = await load_manifest(store, key)
        except NotFound:
            break  # retention cut the chain here (or never had anything older)
        chain.append(manifest)
        key = manifest.previous
    return chain


async def apply_retention(store: Store, run_id: str, keep_last: int, pinned: set[int]) -> list[int]:
    """Delete the committed checkpoints that are not wanted any more; returns their steps.

    Kept: the newest `keep_last` checkpoints of the chain (at least the one `latest`
    names, whatever `keep_last` says), every checkpoint whose step is in `pinned`, and
    every final checkpoint. Each other checkpoint loses its files and then its manifest.
    Steps in `pinned` that have no pin marker yet get one, before anything is deleted:
    once retention cuts the chain above them, garbage collection knows them only so.

    Precondition: call this only once the commit that made the current `latest` is
    durable — right after its pointer compare-and-swap succeeded. Retention counts the
    checkpoints to keep from the `latest` it reads; were that pointer write still to be
    lost, `latest` would fall back to a predecessor this call may already have deleted.

    With `keep_last` = 1, a restore that finds latest's files damaged has nothing to walk
    back to; a restore racing a commit plus this call may even see its latest vanish.
    Keep at least 2 for a fallback.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, not {keep_last}")
    for step in sorted(pinned - await pins(store, run_id)):
        await pin(store, run_id, step)
    chain = await committed_chain(store, run_id)
    doomed = [
        m
        for i, m in enumerate(chain)
        if i >= max(keep_last, 1) and m.step not in pinned and not m.final
    ]
    # Oldest first: a crash part-way then leaves the newer doomed checkpoints still
    # reachable from `latest`, and the next pass finishes them. A checkpoint's files go
    # before its manifest for the same reason.
    for manifest in reversed(doomed):
        await _delete_checkpoint(store, run_id, manifest)
    steps = [m.step for m in doomed]
    # A witness belongs to a step; it goes with the last checkpoint at that step. One left
    # behind by a crash here is a few hundred bytes that nothing reads.
    kept = {m.step for m in chain if m not in doomed}
    await asyncio.gather(*(store.delete(witness_key(run_id, s)) for s in set(steps) - kept))
    if steps:
        log.info("run %s: retention removed checkpoints at steps %s", run_id, steps)
    return steps


async def _delete_checkpoint(store: Store, run_id: str, manifest: Manifest) -> None:
    own = f"{_run_prefix(run_id)}data/"
    keys = []
    for ref in manifest.files:
        if ref.key.startswith(own):
            keys.append(ref.key)
        else:
            # The checkpointer never commits such a file; a manifest naming one is forged
            # or damaged, and must not make retention delete another run's data.
            log.warning("run %s: manifest names %s outside the run; left alone", run_id, ref.key)
    await asyncio.gather(*(store.delete(k) for k in keys))
    await store.delete(manifest_key(run_id, manifest.step, manifest.token))


class Sightings:
    """When this collector first saw each object it could delete, on its own monotonic
    clock: an object's age is how long it has been seen, which no other host's clock can
    skew. Kept in memory for the objects that are candidates now, and forgotten as they go."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._first: dict[str, float] = {}

    def age(self, key: str) -> float:
        """Seconds since `key` was first seen (0 the first time)."""
        now = self._clock()
        return now - self._first.setdefault(key, now)

    def keep_only(self, prefix: str, keys: Iterable[str]) -> None:
        """Forget the objects under `prefix` that are not among `keys` (gone, or adopted)."""
        wanted = set(keys)
        for key in [k for k in self._first if k.startswith(prefix) and k not in wanted]:
            del self._first[key]

    def forget(self, run_id: str) -> None:
        """Forget a run's objects (it retired: nothing of it is collected any more)."""
        self.keep_only(_run_prefix(run_id), ())

    def __len__(self) -> int:
        return len(self._first)


async def collect_garbage(
    store: Store, run_id: str, older_than_s: float, seen: Sightings | None = None
) -> list[str]:
    """Delete the run's data and manifest objects that never became part of a checkpoint
    and that `seen` has seen for at least `older_than_s`; returns their keys. With
    `older_than_s` 0 (a run retiring) no age is asked, and `seen` may be None.

    Kept whatever their age: the checkpoints in the committed chain, every checkpoint at a
    pinned step or with a final manifest (retention keeps those even after it cut the
    chain above them), and anything that a commit could still adopt: a (token, step) above
    the one `latest` names, such as an upload whose commit is queued. No object's
    last-modified time is read: see the module's docstring.
    """
    old_enough = _aged(older_than_s, seen)
    root = _run_prefix(run_id)
    # Listed before `latest` is read: a commit landing in between is then part of the
    # chain we read, and one landing later names a checkpoint above the latest we saw.
    objects = [*await store.list_info(root + "data/"), *await store.list_info(root + "manifests/")]
    current = await read_latest(store, run_id)
    chain = await _walk(store, current[0].checkpoint if current else None)
    # Exact keys, not (token, step): an object under a committed checkpoint's prefix that
    # its manifest does not name (a file of a crashed attempt at the same step) is garbage.
    committed = {manifest_key(run_id, m.step, m.token) for m in chain}
    committed.update(ref.key for m in chain for ref in m.files)
    # Read after the walk: a cut the walk ran into was made by a retention pass that had
    # already written its pins, so every checkpoint kept behind the cut is pinned here.
    pinned = await pins(store, run_id)
    dropped = await abandoned(store, run_id)

    old: dict[Checkpoint | None, list[str]] = {}
    manifests: dict[Checkpoint, str] = {}
    candidates = []
    for info in objects:
        ident, is_manifest = _identify(info.key.removeprefix(root))
        if ident is not None and is_manifest:
            manifests[ident] = info.key
        if info.key in committed or (ident is not None and not _superseded(ident, current)):
            continue
        candidates.append(info.key)
        if old_enough(info.key):
            old.setdefault(ident, []).append(info.key)

    deleted: list[str] = []
    for ident, keys in old.items():
        manifest = manifests.get(ident) if ident is not None else None
        if ident is not None and await _protected(store, ident, manifest, pinned, dropped):
            continue
        # Manifest last: while it exists, a later pass still sees this checkpoint whole.
        await asyncio.gather(*(store.delete(k) for k in keys if k != manifest))
        if manifest is not None and manifest in keys:
            await store.delete(manifest)
        deleted.extend(keys)
    if seen is not None:
        seen.keep_only(root, set(candidates) - set(deleted))
    if deleted:
        log.info("run %s: garbage collection removed %d objects", run_id, len(deleted))
    return sorted(deleted)


def _aged(older_than_s: float, seen: Sightings | None) -> Callable[[str], bool]:
    """Whether an object has been seen for `older_than_s` (always, for 0)."""
    if older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, not {older_than_s}")
    if older_than_s == 0:
        return lambda key: True
    if seen is None:
        raise ValueError("an age needs the collector's sightings")
    return lambda key: seen.age(key) >= older_than_s


def _identify(relative: str) -> tuple[Checkpoint | None, bool]:
    """(token, step) of a data or manifest key, and whether it is the manifest. None for a
    key no commit would ever name, which is garbage as soon as it is old enough."""
    if m := _DATA.fullmatch(relative):
        return (int(m[1]), int(m[2])), False
    if m := _MANIFEST.fullmatch(relative):
        return (int(m[2]), int(m[1])), True
    return None, False


def _superseded(ident: Checkpoint, current: tuple[Pointer, str] | None) -> bool:
    """Whether `latest` has moved past this checkpoint, so no commit can adopt it: the
    pointer only grows in (token, step), and a commit must supersede it to land. Strict,
    so that the checkpoint `latest` names is never garbage, even were its manifest lost."""
    if current is None:
        return False
    latest = current[0]
    return ident < (latest.token, latest.step)


async def _protected(
    store: Store, ident: Checkpoint, manifest: str | None, pinned: set[int], dropped: set[str]
) -> bool:
    """Whether an unreachable checkpoint may be one retention chose to keep. Without a
    manifest it is not a checkpoint (never committed, or retention's leftovers). With one,
    a zombie's manifest and a kept checkpoint behind a cut look alike; pinned steps and
    final manifests are kept either way, at the price of keeping such a zombie too. One a
    rollback abandoned (`dropped`) is kept only for a pin: a final one it left is no end."""
    if manifest is None:
        return False
    if ident[1] in pinned:
        return True
    if manifest in dropped:
        return False
    try:
        return (await load_manifest(store, manifest)).final
    except NotFound:
        return False
    except ContractError:
        log.warning("%s does not decode; kept for an operator to judge", manifest)
        return True
