"""The commit protocol, on top of any `Store`.

    1. tensor files  -> runs/<run>/data/<token>/<step>/<name>   immutable, written by the trainer
    2. manifest      -> runs/<run>/manifests/<step>-<token>.json  write-once (the commit point)
    3. latest        -> runs/<run>/latest                         CAS, ordered by (token, step)

A checkpoint exists once `latest` names its manifest. Step 3 is decided by the store: the
pointer write is conditional on the version just read, and the order check is made on that
same version, so a fenced worker (lower token) can never overwrite a newer pointer however
late its request arrives — it either fails the order check or loses the conditional write
and re-reads a pointer it cannot supersede.
"""

from __future__ import annotations

import time

from shared.contracts import CommitRequest, FileRef, Manifest, Pointer, decode, encode
from shared.errors import (
    AlreadyExists,
    ContractError,
    Fenced,
    IntegrityError,
    NotFound,
    PreconditionFailed,
)
from shared.store import Store


def data_key(run_id: str, token: int, step: int, name: str) -> str:
    return f"runs/{run_id}/data/{token:012d}/{step:012d}/{name}"


def manifest_key(run_id: str, step: int, token: int) -> str:
    return f"runs/{run_id}/manifests/{step:012d}-{token:012d}.json"


def latest_key(run_id: str) -> str:
    return f"runs/{run_id}/latest"


async def read_latest(store: Store, run_id: str) -> tuple[Pointer, str] | None:
    found = await store.read_pointer(latest_key(run_id))
    if found is None:
        return None
    data, version = found
    return decode(data, Pointer), version


async def load_manifest(store: Store, key: str) -> Manifest:
    return decode(await store.get(key), Manifest)


async def verify(store: Store, files: list[FileRef]) -> int:
    """Read every file back and check its size and sha256. Returns the total bytes."""
    total = 0
    for ref in files:
        try:
            size, digest = await store.stat(ref.key)
        except NotFound:
            raise IntegrityError(f"{ref.name}: missing from the store ({ref.key})") from None
        if size != ref.size:
            raise IntegrityError(f"{ref.name}: {size} bytes stored, {ref.size} declared")
        if digest != ref.sha256:
            raise IntegrityError(f"{ref.name}: sha256 {digest[:12]}… differs from declared")
        total += size
    return total


async def commit(store: Store, req: CommitRequest) -> tuple[Pointer, int]:
    """Commit a checkpoint; returns the new pointer and the bytes committed.

    Raises `IntegrityError` if a file does not match its declaration, `Fenced` if `latest`
    already names a checkpoint that this one cannot supersede, `ContractError` if the request
    names files outside its own immutable prefix. Safe to repeat: a redelivered request that
    already committed returns the same pointer.
    """
    names = set()
    for ref in req.files:
        if ref.key != data_key(req.run_id, req.token, req.step, ref.name):
            raise ContractError(f"file {ref.name!r} is not under this checkpoint's prefix")
        if ref.name in names:
            raise ContractError(f"file {ref.name!r} listed twice")
        names.add(ref.name)
    if not req.files:
        raise ContractError("a checkpoint needs at least one file")

    size = await verify(store, req.files)
    wanted = Pointer(
        run_id=req.run_id,
        token=req.token,
        step=req.step,
        manifest=manifest_key(req.run_id, req.step, req.token),
        final=req.final,
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
        previous=current[0].manifest if current else None,
        created_at=time.time(),
    )
    try:
        await store.put_once(wanted.manifest, encode(manifest))
    except AlreadyExists:
        existing = await load_manifest(store, wanted.manifest)
        if existing.files != req.files:
            raise Fenced(
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


def _check_order(wanted: Pointer, current: tuple[Pointer, str] | None) -> None:
    if current is not None and not wanted.supersedes(current[0]):
        have = current[0]
        raise Fenced(
            f"latest is token {have.token} step {have.step}; "
            f"token {wanted.token} step {wanted.step} cannot supersede it"
        )


async def restorable(store: Store, run_id: str) -> tuple[Manifest | None, list[int]]:
    """The newest committed checkpoint whose files all verify, walking back through
    `previous` past any that were damaged after their commit; and the steps skipped.

    A `previous` naming a manifest that is gone ends the walk: retention
    (`shared.retention`) deletes old checkpoints, manifest included, so the chain
    legitimately stops where retention cut it."""
    current = await read_latest(store, run_id)
    key = current[0].manifest if current else None
    damaged: list[int] = []
    while key is not None:
        try:
            manifest = await load_manifest(store, key)
        except NotFound:
            break
        try:
            await verify(store, manifest.files)
            return manifest, damaged
        except IntegrityError:
            damaged.append(manifest.step)
            key = manifest.previous
    return None, damaged
