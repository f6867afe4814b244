"""The commit protocol, on top of any `Store`.

    1. tensor files  -> runs/<run>/data/<token>/<step>/<name>   immutable, written by the trainer
    2. manifest      -> runs/<run>/manifests/<step>-<token>.json  write-once (the commit point)
    3. latest        -> runs/<run>/latest                         CAS, ordered by (token, step)

Beside them, `runs/<run>/witness/<step>.json` (write-once, not part of any commit) keeps what
the steps after a checkpoint reported, so a resume can check itself (`baton.runtime.witness`).

Before a checkpoint is committed, and again before one is restored, its files are checked
(`verify`): names and keys (`shared.checkpoint.files`), sizes and sha256, and each tensor
file's safetensors header. `restorable` is the one place that decides a checkpoint is damaged.

A run of several ranks commits one checkpoint for all of them: the request lists every
rank's shard (`CommitRequest.ranks`), and one that lacks any is refused before anything is
written — a checkpoint some rank cannot resume from is no checkpoint. The manifest records
the group's size, and a checkpoint resumes only at that size (`check_ranks`), but for an
elastic run's. Objects sharded across the ranks (`CommitRequest.sharded`: FSDP2) are every
rank's chunks, and a commit is refused unless they tile each tensor exactly
(`shared.checkpoint.shards`).

A checkpoint exists once `latest` names its manifest. Step 3 is decided by the store: the
pointer write is conditional on the version just read, and the order check is made on that
same version, so a fenced worker (lower token) can never overwrite a newer pointer however
late its request arrives — it either fails the order check or loses the conditional write
and re-reads a pointer it cannot supersede.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import msgspec

from shared.checkpoint import files as checkpoint_files
from shared.checkpoint import shards
from shared.checkpoint.store import Store
from shared.checkpoint.store.base import sha256_file
from shared.contracts import CommitRequest, FileRef, Manifest, Pointer, decode, encode
from shared.errors import (
    AlreadyExists,
    ContractError,
    FinalCommitted,
    IntegrityError,
    NotFound,
    PreconditionFailed,
    StaleToken,
)

log = logging.getLogger("baton.commit")


def data_key(run_id: str, token: int, step: int, name: str) -> str:
    return f"runs/{run_id}/data/{token:012d}/{step:012d}/{name}"


def manifest_key(run_id: str, step: int, token: int) -> str:
    return f"runs/{run_id}/manifests/{step:012d}-{token:012d}.json"


def key_of(manifest: Manifest) -> str:
    """Where a manifest is stored."""
    return manifest_key(manifest.run_id, manifest.step, manifest.token)


def witness_key(run_id: str, step: int) -> str:
    """What the steps right after the checkpoint at `step` reported (`baton.runtime.witness`)."""
    return f"runs/{run_id}/witness/{step:012d}.json"


def latest_key(run_id: str) -> str:
    return f"runs/{run_id}/latest"


def rewind_key(run_id: str, token: int, from_token: int, from_step: int) -> str:
    """Where a rollback's note is written before it moves `latest` (`Rewound`)."""
    return f"{rewinds_prefix(run_id)}{token:012d}-{from_token:012d}-{from_step:012d}.json"


def rewinds_prefix(run_id: str, token: int | None = None) -> str:
    """The run's rollback notes (those of the attempt of `token` alone, if given)."""
    return f"runs/{run_id}/rewinds/" + ("" if token is None else f"{token:012d}-")


def step_of(key: str) -> int:
    """The step a manifest key names (`manifest_key`)."""
    return int(key.rsplit("/", 1)[1][:12])


async def read_latest(store: Store, run_id: str) -> tuple[Pointer, str] | None:
    found = await store.read_pointer(latest_key(run_id))
    if found is None:
        return None
    data, version = found
    return decode(data, Pointer), version


async def load_manifest(store: Store, key: str) -> Manifest:
    return decode(await store.get(key), Manifest)


async def verify(store: Store, files: list[FileRef], sharded: Collection[str] = ()) -> int:
    """Read every file back and check its size and sha256, that each tensor file has a
    well-formed safetensors header, and that the ranks' chunks of each `sharded` group tile
    its tensors exactly (`shared.checkpoint.shards`). Returns the total bytes."""
    total = 0
    chunks: dict[str, list[shards.Chunk]] = {g: [] for g in sharded}
    with tempfile.TemporaryDirectory(prefix="baton-verify-") as tmp:
        # Tensor files are read back into a local copy: the store only reads whole objects,
        # and the header checked is then that of the very bytes that were hashed. The copy
        # is never named after the file: the name is not trusted yet.
        local = Path(tmp) / "object"
        for ref in files:
            tensors = checkpoint_files.is_tensor_file(ref.name)
            try:
                if tensors:
                    await store.download(ref.key, local)
                    size, digest = await asyncio.to_thread(sha256_file, local)
                else:
                    size, digest = await store.stat(ref.key)
            except NotFound:
                raise IntegrityError(f"{ref.name}: missing from the store ({ref.key})") from None
            if size != ref.size:
                raise IntegrityError(f"{ref.name}: {size} bytes stored, {ref.size} declared")
            if digest != ref.sha256:
                raise IntegrityError(f"{ref.name}: sha256 {digest[:12]}… differs from declared")
            if tensors:
                header = await asyncio.to_thread(checkpoint_files.header_of, local, ref.name)
                if (group := checkpoint_files.group_of(ref.name)) in chunks:
                    chunks[group] += shards.chunks_of(header, ref.name)
            total += size
    for group, found in chunks.items():
        shards.tile(found, group)
    return total


async def commit(store: Store, req: CommitRequest, site: str = "") -> tuple[Pointer, int]:
    """Commit a checkpoint; returns the new pointer and the bytes committed. `site`: the
    side whose checkpointer commits it ("" the hub), written into the pointer.

    Raises `IntegrityError` if a file does not match its declaration, `StaleToken` if `latest`
    already names a checkpoint that this one cannot supersede, `ContractError` if the request
    names files outside its own immutable prefix or by names that are not checkpoint file
    names. Safe to repeat: a redelivered request that already committed returns the same
    pointer.

    A request that lacks a rank's shard (`req.ranks`) raises `IntegrityError`, before any
    write: the checkpointer then tells the trainer (`commit_refused`) rather than only
    dead-lettering the request, so an attempt waiting for that commit learns of it at once.
    """
    try:
        checkpoint_files.check_refs(req.files, data_key(req.run_id, req.token, req.step, ""))
    except IntegrityError as exc:
        raise ContractError(str(exc)) from None  # a bad request, not bad stored bytes
    checkpoint_files.check_shards({f.name for f in req.files}, req.ranks, req.sharded)
    size = await verify(store, req.files, req.sharded)
    wanted = Pointer(
        run_id=req.run_id,
        token=req.token,
        step=req.step,
        manifest=manifest_key(req.run_id, req.step, req.token),
        final=req.final,
        site=site,
    )
    current = await read_latest(store, req.run_id)
    if current is not None and current[0] == wanted:
        return wanted, size  # this very commit already went through; a redelivery
    _check_order(wanted, current)

    manifest = Manifest(
        run_id=req.run_id,
        token=req.token,
        step=req.step,
        worker=req.worker,
        files=req.files,
        final=req.final,
        metrics=req.metrics,
        digest=req.digest,
        previous=current[0].checkpoint if current else None,
        created_at=time.time(),
        ranks=req.ranks,
        sharded=req.sharded,
    )
    try:
        await store.put_once(wanted.manifest, encode(manifest))
    except AlreadyExists:
        existing = await load_manifest(store, wanted.manifest)
        if existing.files != req.files:
            raise StaleToken(
                f"a different manifest for step {req.step} token {req.token} exists"
            ) from None

    while True:
        try:
            await store.write_pointer(
                latest_key(req.run_id), encode(wanted), current[1] if current else None
            )
            return wanted, size
        except PreconditionFailed:
            current = await read_latest(store, req.run_id)
            if current is not None and current[0] == wanted:
                return wanted, size
            _check_order(wanted, current)


def check_ranks(manifest: Manifest, ranks: int, elastic: bool = False) -> None:
    """Refuse to resume a group of `ranks` from a checkpoint written by a group of another
    size: its shards hold one data position and RNG state per rank it was written by, and
    there is no sound way to split or merge them. An elastic run's checkpoints hold one
    state (rank 0's; every rank's is the same) and resume at any size, its sharded objects
    included: each rank reads the chunks it owns at the new size (`baton.runtime.shards`)."""
    if elastic and (manifest.ranks == 1 or manifest.sharded):
        return
    if manifest.ranks != ranks:
        raise IntegrityError(
            f"checkpoint {manifest.step} was written by {manifest.ranks} rank(s) and cannot be"
            f" resumed by {ranks}: a run keeps the number of ranks it started with"
            + (" (an elastic run's checkpoint holds rank 0's state alone)" if elastic else "")
        )


def _check_order(wanted: Pointer, current: tuple[Pointer, str] | None) -> None:
    """Refuse `wanted` unless it supersedes `latest`. A final checkpoint is terminal: once
    `latest` names one, the run was trained to the end and nothing follows it, whatever
    its token (`check_open`)."""
    if current is None:
        return
    have = current[0]
    check_open(have)
    if not wanted.supersedes(have):
        raise StaleToken(
            f"latest is token {have.token} step {have.step}; "
            f"token {wanted.token} step {wanted.step} cannot supersede it"
        )


def check_open(latest: Pointer) -> None:
    """`FinalCommitted` if `latest` is the run's final checkpoint, or seals its end
    (`seal`): the store refuses any commit, rewind or fence after it."""
    side = f"site {latest.site}" if latest.site else "the hub"
    if latest.final:
        raise FinalCommitted(
            f"the run's final checkpoint (step {latest.step}, token {latest.token}, by "
            f"{side}) is committed: nothing may follow it"
        )
    if latest.ended:
        raise FinalCommitted(
            f"the run was {latest.ended} by {side} at step {latest.step}: nothing may follow"
        )


async def seal(store: Store, run_id: str, ended: str, site: str = "") -> bool:
    """Seal the end of a run that ended without its final checkpoint (`ended`, e.g.
    "cancelled", by `site`, "" the hub): `latest` keeps naming its newest checkpoint, and
    refuses every commit after it (`check_open`), whichever side or token — so an attempt
    the end did not reach (a site cut off that accepted the same job) trains in vain and
    learns it at its next look at the store (`shared.state.owner`). With no checkpoint
    yet, a fence alone is written (token 0). True once sealed (or sealed before); False
    when `latest` is final already (the run was trained to the end)."""
    while True:
        current = await read_latest(store, run_id)
        if current is None:
            pointer = Pointer(run_id=run_id, token=0, step=0, manifest="", ended=ended, site=site)
            version = None
        else:
            have, version = current
            if have.final:
                return False
            if have.ended:
                return True
            pointer = msgspec.structs.replace(have, ended=ended, site=site)
        try:
            await store.write_pointer(latest_key(run_id), encode(pointer), version)
            return True
        except PreconditionFailed:
            continue


async def restorable(store: Store, run_id: str) -> tuple[Manifest | None, list[int]]:
    """The newest committed checkpoint whose files all verify, walking back through
    `previous` past any that were damaged after their commit, or that are refused (a
    manifest that breaks its contract or names files it may not: another run's, a path);
    and the steps skipped. `IntegrityError` if a manifest is too broken to walk past.

    A `previous` naming a manifest that is gone ends the walk: retention
    (`shared.checkpoint.retention`) deletes old checkpoints, manifest included, so the chain
    legitimately stops where retention cut it."""
    current = await read_latest(store, run_id)
    key = current[0].checkpoint if current else None
    damaged: list[int] = []
    seen: set[str] = set()
    while key is not None:
        if key in seen:  # only a forged chain can loop; without this, restore would hang
            raise IntegrityError(f"manifest {key} is its own ancestor")
        seen.add(key)
        try:
            data = await store.get(key)
        except NotFound:
            break
        try:
            try:
                manifest = decode(data, Manifest)
            except ContractError as exc:
                raise IntegrityError(f"manifest {key}: {exc}") from None
            await check(store, run_id, manifest, key)
            return manifest, damaged
        except IntegrityError as exc:
            link = _link(key, data)
            log.warning("run %s: checkpoint %d is damaged, skipped: %s", run_id, link.step, exc)
            damaged.append(link.step)
            key = link.previous
    return None, damaged


async def check(
    store: Store, run_id: str, manifest: Manifest, key: str, *, read: bool = True
) -> None:
    """`IntegrityError` unless the manifest stored at `key` is one of `run_id`'s whose files
    are all its own, name every rank's shard and (`read`) all verify: the one decision that
    a committed checkpoint may be restored (`restorable`), rolled back to or forked from
    (`shared.checkpoint.rebase`)."""
    if manifest.run_id != run_id:
        raise IntegrityError(f"manifest {key} belongs to run {manifest.run_id!r}")
    if key_of(manifest) != key:
        raise IntegrityError(f"manifest {key} names step {manifest.step} token {manifest.token}")
    prefix = data_key(run_id, manifest.token, manifest.step, "")
    checkpoint_files.check_refs(manifest.files, prefix)
    checkpoint_files.check_shards(
        {f.name for f in manifest.files}, manifest.ranks, manifest.sharded
    )
    if read:
        await verify(store, manifest.files, manifest.sharded)


class _Link(msgspec.Struct, frozen=True):
    """What the walk back needs of a manifest, readable even when the rest of it is not."""

    step: int
    previous: str | None


def _link(key: str, data: bytes) -> _Link:
    try:
        return decode(data, _Link)
    except ContractError as exc:
        raise IntegrityError(f"manifest {key} is unreadable, no way back past it: {exc}") from None
