"""Making an existing committed checkpoint a run's `latest`: a rollback, or a fork's graft.

Invariant: this is a commit like any other, made by the checkpointer alone and decided by
the same compare-and-swap on `latest` — ordered by (token, step), so the pointer it writes
must supersede the one it replaces, under the token of the attempt that asked. A rollback
goes back in steps, so only a newer attempt's higher token can write it: the attempt that
trained past the step was stopped first, and a zombie of it (a lower token) can neither
rewind `latest` nor commit past the rewound pointer.

* **Rewind** (a `CommitRequest` whose `base` is the run's own checkpoint at `step`). The
  target must be on the run's chain and verify (`lineage.find`); a note (`Rewound`) naming
  the checkpoints after it is written once, then `latest` is pointed at the target's own
  manifest under the new token. The target's files stay where they are; the checkpoints
  after it leave the chain — never restored, kept until garbage collection — and the next
  commit's `previous` is the target. A pointer that moved meanwhile (a late commit of the
  stopped attempt) is read again and the whole decision made anew, with a new note.
* **Graft** (`base` is another run's checkpoint: a fork's first). Allowed only into a run
  with no checkpoint yet, and, for a submitter's run, from that submitter's own runs. Every
  file of the parent's checkpoint (on its chain or abandoned) is copied inside the store
  into the fork's prefix under the fork's token; each `meta.json` is adopted — its run id
  and spec hash made the fork's, its origin recorded — since a checkpoint is restored only
  by the run and spec it names. The copies are verified against the parent's manifest (the
  tensors' bytes are the parent's, byte for byte), a manifest is written once with the
  parent's weights digest, and `latest` is created. The parent's retention can then delete
  its own checkpoint: the fork's base is its own.

Both are safe to repeat: a redelivered request finds its pointer already written and
returns what it did.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
from pathlib import Path

import msgspec

from shared.checkpoint import files as checkpoint_files
from shared.checkpoint import lineage, retention
from shared.checkpoint.commit import (
    check,
    check_open,
    data_key,
    key_of,
    latest_key,
    load_manifest,
    manifest_key,
    read_latest,
    rewind_key,
    step_of,
    verify,
)
from shared.checkpoint.store import Store
from shared.contracts import CommitRequest, FileRef, Manifest, Pointer, decode, encode
from shared.contracts.checkpoints import Base, Rewound
from shared.contracts.events import Event, Forked, RolledBack
from shared.errors import (
    AlreadyExists,
    ContractError,
    IntegrityError,
    PreconditionFailed,
    StaleToken,
)


class Rebased(msgspec.Struct, frozen=True, kw_only=True):
    """What a rebase did: the pointer written, and the rollback's note or the graft's
    manifest with the parent's it was copied from."""

    pointer: Pointer
    rewound: Rewound | None = None
    grafted: Manifest | None = None

    def event(self) -> Event:
        """`rolled_back` or `forked`: what the checkpointer tells of it."""
        p = self.pointer
        if self.rewound is not None:
            n = self.rewound
            return RolledBack(
                run_id=p.run_id, token=p.token, from_step=n.from_step, to_step=n.to_step,
                abandoned=[step_of(k) for k in n.abandoned], reason=n.reason,
            )  # fmt: skip
        assert self.grafted is not None and self.grafted.grafted_from is not None
        parent = self.grafted.grafted_from.split("/")[1]
        return Forked(
            run_id=p.run_id, token=p.token, parent=parent, step=p.step, manifest=p.manifest,
            digest=self.grafted.digest,
        )  # fmt: skip


async def rebase(store: Store, req: CommitRequest, site: str = "") -> Rebased:
    """Carry out `req` (its `base` set): a rewind of the run's own, or a graft of another
    run's checkpoint. `IntegrityError` when the checkpoint cannot be used (not committed on
    the chain, gone, damaged, not the submitter's); `StaleToken` when `latest` names a
    checkpoint this request cannot supersede; `ContractError` for a malformed request."""
    base = req.base
    if base is None or req.files or req.final or base.step != req.step:
        raise ContractError("a rebase names its checkpoint in `base` alone, at its `step`")
    if base.run_id == req.run_id:
        return await rewind(store, req.run_id, req.token, base, site)
    return await graft(store, req.run_id, req.token, req.worker, base, site)


async def rewind(
    store: Store, run_id: str, token: int, base: Base, site: str = ""
) -> Rebased:
    """Point `latest` back at the run's committed checkpoint at `base.step`, under `token`."""
    while True:
        current = await read_latest(store, run_id)
        if current is None:
            raise IntegrityError(f"run {run_id} has no committed checkpoint to go back to")
        now, version = current
        if now.token == token and now.step == base.step:
            return Rebased(pointer=now, rewound=await _note(store, run_id, now))
        check_open(now)  # a run trained to the end is forked, never rewound
        target = await lineage.find(store, run_id, base.step, resumable=True)
        chain = await retention.committed_chain(store, run_id)
        keys = [key_of(m) for m in chain]
        if target.key not in keys:  # latest moved between the two reads: look again
            continue
        wanted = Pointer(
            run_id=run_id, token=token, step=base.step, manifest=target.key, site=site
        )
        if not wanted.supersedes(now):
            raise StaleToken(
                f"latest is token {now.token} step {now.step}; a rollback under token "
                f"{token} cannot supersede it"
            )
        note = Rewound(
            run_id=run_id, token=token, from_token=now.token, from_step=now.step,
            to_step=base.step, manifest=target.key, abandoned=keys[: keys.index(target.key)],
            reason=base.reason, created_at=time.time(),
        )  # fmt: skip
        note = await _write_note(store, note)
        try:
            await store.write_pointer(latest_key(run_id), encode(wanted), version)
        except PreconditionFailed:
            continue  # someone moved `latest`: decide again on what it names now
        return Rebased(pointer=wanted, rewound=note)


async def _write_note(store: Store, note: Rewound) -> Rewound:
    key = rewind_key(note.run_id, note.token, note.from_token, note.from_step)
    try:
        await store.put_once(key, encode(note))
    except AlreadyExists:  # a redelivery decided the same before; its note stands
        return decode(await store.get(key), Rewound)
    return note


async def _note(store: Store, run_id: str, pointer: Pointer) -> Rewound:
    """The note of the rewind that wrote `pointer` (a redelivered request): of those written
    under its token for its manifest, the one that replaced the highest pointer, which is
    the one whose write won (the pointer only grows)."""
    notes = [
        n for n in await retention.rewinds(store, run_id, pointer.token)
        if n.manifest == pointer.manifest
    ]  # fmt: skip
    if not notes:
        raise IntegrityError(f"run {run_id}: latest was rewound without a note")
    return max(notes, key=lambda n: (n.from_token, n.from_step))


async def graft(
    store: Store, run_id: str, token: int, worker: str, base: Base, site: str = ""
) -> Rebased:
    """Copy `base` (another run's committed checkpoint) into `run_id` as its first."""
    if _owner(run_id) and _owner(base.run_id) != _owner(run_id):
        raise IntegrityError(f"run {run_id} may not fork {base.run_id}: a submitter forks its own")
    if not base.spec_hash:
        raise ContractError("a fork's graft names the fork's spec hash", "$.base.spec_hash")
    key = manifest_key(run_id, base.step, token)
    wanted = Pointer(run_id=run_id, token=token, step=base.step, manifest=key, site=site)
    current = await read_latest(store, run_id)
    fenced = current is not None and current[0].checkpoint is None
    if current is not None and not (fenced and wanted.supersedes(current[0])):
        if current[0] == wanted:  # a redelivery: this graft went through
            return Rebased(pointer=wanted, grafted=await load_manifest(store, key))
        have = current[0]
        raise StaleToken(
            f"run {run_id} has a checkpoint already (token {have.token} step {have.step}): "
            "a fork is grafted only onto a run that has none"
        )
    source = await lineage.find(store, base.run_id, base.step, anywhere=True)
    parent = source.manifest
    files = [await _copy(store, ref, run_id, token, base) for ref in parent.files]
    # Every copy against the parent's manifest: the fork's tensors are the parent's bytes.
    await verify(store, files, parent.sharded)
    manifest = Manifest(
        run_id=run_id, token=token, step=base.step, worker=worker, files=files, final=False,
        metrics=parent.metrics, digest=parent.digest, previous=None, created_at=time.time(),
        ranks=parent.ranks, sharded=parent.sharded, grafted_from=source.key,
    )  # fmt: skip
    await check(store, run_id, manifest, key, read=False)
    try:
        await store.put_once(key, encode(manifest))
    except AlreadyExists:
        existing = await load_manifest(store, key)
        if existing.files != files:
            raise StaleToken(f"a different manifest for step {base.step} token {token}") from None
        manifest = existing
    try:
        await store.write_pointer(
            latest_key(run_id), encode(wanted), current[1] if fenced and current else None
        )
    except PreconditionFailed:
        again = await read_latest(store, run_id)
        if again is None or again[0] != wanted:
            raise StaleToken(f"run {run_id} committed a checkpoint while it was grafted") from None
    return Rebased(pointer=wanted, grafted=manifest)


async def _copy(store: Store, ref: FileRef, run_id: str, token: int, base: Base) -> FileRef:
    """One file of the parent's checkpoint, written under the fork's prefix: tensors and a
    framework's files as they are, each `meta.json` adopted by the fork."""
    dst = data_key(run_id, token, base.step, ref.name)
    if _meta_file(ref.name):
        data = await _adopted(store, ref, run_id, base)
        # Written before by a redelivery of this graft: verified with the rest.
        with contextlib.suppress(AlreadyExists):
            await store.put_once(dst, data)
        return FileRef(name=ref.name, key=dst, size=len(data), sha256=_sha(data))
    with contextlib.suppress(AlreadyExists):
        await store.copy(ref.key, dst)
    return msgspec.structs.replace(ref, key=dst)


async def _adopted(store: Store, ref: FileRef, run_id: str, base: Base) -> bytes:
    """The parent's meta.json as the fork's: its run id and spec hash, and where it came
    from. Serialised as the training process writes it (sorted keys), so a redelivery
    writes the same bytes."""
    with tempfile.TemporaryDirectory(prefix="baton-graft-") as tmp:
        local = Path(tmp) / "meta"
        await store.download(ref.key, local)
        if _sha(local.read_bytes()) != ref.sha256:
            raise IntegrityError(f"{ref.name}: its bytes differ from the parent's manifest")
        meta = checkpoint_files.read_meta(local)
    if meta.get("run_id") != base.run_id or meta.get("step") != base.step:
        raise IntegrityError(f"{ref.name} is not run {base.run_id}'s at step {base.step}")
    meta["forked_from"] = {
        "run_id": base.run_id, "step": base.step, "spec_hash": meta.get("spec_hash"),
    }  # fmt: skip
    meta["run_id"], meta["spec_hash"] = run_id, base.spec_hash
    return json.dumps(meta, sort_keys=True).encode()


def _meta_file(name: str) -> bool:
    rank = checkpoint_files.rank_of(name)
    return name.removeprefix(checkpoint_files.rank_prefix(rank)) == checkpoint_files.META


def _owner(run_id: str) -> str:
    """The submitter a run belongs to ("" for an operator's: `run_id_for`)."""
    return run_id.rpartition(".")[0]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
