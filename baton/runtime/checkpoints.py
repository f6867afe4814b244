"""A run's checkpoints as its training process sees them: what is registered, when one is
due, this rank's part of one and how it reaches the store, and finding and loading the one
to resume from. `RunContext` is the user's API over it.

**When** (`due`): when the trainer asks (preemption, `baton checkpoint`), or on the job's
policy (`every_steps`, `every_seconds`). A periodic checkpoint never waits for the write
before it: it is postponed to the first step after that write is done
(`baton.runtime.snapshot`). In a group every rank acts on what any rank has, agreed once per
step (one all-reduce), so all of them checkpoint, and stop, at the same step.

**What** (`state`): per registered name one safetensors file and a JSON tree
(`baton.runtime.slots`), plus the global RNG states and meta.json. In a group rank 0 writes
what the ranks share (models, optimizers, JSON values) and its own shard; the others only
theirs (`rank<k>.` files: data positions, generators, RNG states, cursor). An object sharded
across the ranks (FSDP2) is every rank's chunks (`baton.runtime.shards`). An elastic run's
checkpoint is rank 0's alone — every rank holds the same state (`baton.runtime.exact`) — but
for its sharded objects, whose chunks every rank writes.

**How** (`write`): the training loop waits only for the copy into host memory; the writer
thread stores the files, and rank 0's writer gathers every rank's files into the one
`CheckpointReady` the trainer commits (`baton.runtime.group`).

**Resuming** (`find`, `load`): rank 0 picks the newest committed checkpoint that verifies
and shares its choice, so a commit landing while the ranks look cannot split them; each
rank loads what it needs of it (`baton.runtime.load`), and a sharded object's chunks at
whatever size the group is now.

**Between checkpoints** (`keep_local`, `resume_local`): a run of one rank may also keep its
newest state on its host (`baton.runtime.local`), resumed ahead of the newest checkpoint
only while that snapshot continues the store's chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch

from baton.runtime import compat, witness
from baton.runtime.load import Resumed, chosen, load, load_local, rng_state
from baton.runtime.local import LocalSnapshots
from baton.runtime.local import root as local_root
from baton.runtime.slots import Slot
from baton.runtime.snapshot import Snapshot, Snapshotter
from shared.checkpoint import commit
from shared.checkpoint.digest import weights_digest
from shared.checkpoint.files import group_of, rank_prefix
from shared.checkpoint.store import open_store
from shared.contracts import FileRef, Manifest, Pointer, Task, spec_hash
from shared.contracts.child import CheckpointReady, FromChild
from shared.errors import IntegrityError, NotFound

if TYPE_CHECKING:
    from baton.runtime.group import Group

Groups = dict[str, dict[str, torch.Tensor]]


class Found(NamedTuple):
    """What `Checkpoints.find` found to resume from."""

    manifest: Manifest | None
    damaged: list[int]
    """Steps of newer checkpoints that no longer verify, skipped."""
    rows: list[witness.Row] | None
    """The checkpoint's witness (`baton.runtime.witness`)."""
    latest: Pointer | None
    """The store's `latest` as read before (rank 0's only): what a local snapshot must
    continue (`baton.runtime.local`)."""


class Checkpoints:
    def __init__(
        self,
        task: Task,
        token: int,
        store_url: str,
        spool: Path,
        send: Callable[[FromChild], None],
        group: Group | None,
        vet: Callable[[Snapshot], bool],
    ) -> None:
        self.run_id = task.run_id
        self.spec = task.spec
        self.rank = group.rank if group else 0
        self.world_size = group.world_size if group else 1
        self.store_url = store_url
        self.spool = spool
        self._send = send
        self._group = group
        self._vet = vet
        self.slots: list[Slot] = []
        self._snap = Snapshotter(store_url, spool, prefix=rank_prefix(self.rank))
        self.last_saved = -1
        """The step of the newest checkpoint taken (or loaded): none is taken twice."""
        self._last_time = time.monotonic()
        self._postponed = False
        self.write_error: BaseException | None = None
        """What the writer thread failed with; the loop raises it at its next checkpoint."""
        every = task.spec.checkpoint.local_every_seconds
        self.local = (
            LocalSnapshots(local_root(), store_url, self.run_id, token, every)
            if every is not None and group is None and not task.spec.replicated
            else None
        )
        """This host's copy of the newest state (`baton.runtime.local`): one rank only."""
        self.resumed_local = False

    @property
    def sharded(self) -> list[str]:
        return [s.name for s in self.slots if s.sharded]

    # -- when ----------------------------------------------------------------------------

    def due(self, step: int, asked: bool, stop: bool) -> tuple[bool, bool]:
        """Whether a checkpoint of `step` is due now, and whether to stop after it: in a
        group, as every rank agrees."""
        now = time.monotonic()
        policy = self.spec.checkpoint
        periodic = (
            self._postponed
            or (policy.every_steps is not None and step % policy.every_steps == 0)
            or (policy.every_seconds is not None and now - self._last_time >= policy.every_seconds)
        )
        busy = self._snap.busy
        if self._group is not None:
            # Every rank acts on what any rank has: asked, due (`every_seconds` counts on each
            # rank's own clock), still writing. One all-reduce per step, nothing more.
            stop, asked, periodic, busy = self._group.agree([stop, asked, periodic, busy])
        more = step < self.spec.total_steps
        save = more and (asked or (periodic and not busy))
        self._postponed = periodic and not save and more
        return save, stop

    def taken(self, step: int) -> None:
        self.last_saved = step
        self._last_time = time.monotonic()
        self._postponed = False

    # -- what ----------------------------------------------------------------------------

    def state(
        self,
        step: int,
        cursor: dict[str, Any],
        weights: dict[str, torch.Tensor] | None = None,
        *,
        digest: bool = True,
    ) -> tuple[Groups, dict[str, Any], dict[str, dict[str, str]]]:
        """This rank's part of a checkpoint of `step`: tensors by file, its meta.json, and
        each sharded file's `__metadata__`. The digest is of `weights`, or else of the first
        registered object's tensors (a sharded one's: `_written`); none without `digest`
        (a local snapshot's: it is never committed)."""
        groups: Groups = {}
        trees: dict[str, Any] = {}
        headers: dict[str, dict[str, str]] = {}
        for slot in self.slots:
            if slot.sharded:
                from baton.runtime.shards import local

                whole: dict[str, torch.Tensor] = {}
                tree = slot.capture(whole)
                groups[slot.name], headers[slot.name] = local(whole, self.rank)
                if self.rank == 0:  # the tree, and the whole tensors' shapes, are rank 0's
                    trees[slot.name] = tree
            elif self.rank == 0 or slot.per_rank:  # what all ranks share, rank 0 saves
                groups[slot.name] = {}
                trees[slot.name] = slot.capture(groups[slot.name])
        rng_tensors, rng_json = rng_state()
        groups["rng"] = rng_tensors
        meta: dict[str, Any] = {
            "run_id": self.run_id,
            "step": step,
            "cursor": cursor,
            "state": trees,
            "rng": rng_json,
            "spec_hash": spec_hash(self.spec),
        }
        if self.rank > 0:
            meta["rank"] = self.rank
            return groups, meta, headers
        first = next(iter(groups.values())) if weights is None else weights
        digested = digest and not (self.slots and self.slots[0].sharded)
        meta["digest"] = weights_digest(first) if digested else ""
        meta["versions"] = compat.recorded(self.spec.entry_point)
        if self._ranks() > 1:
            meta["ranks"] = self.world_size
        return groups, meta, headers

    def _ranks(self) -> int:
        """How many ranks write a checkpoint: one of an elastic run's unless it shards."""
        return 1 if self.spec.elastic and not self.sharded else self.world_size

    # -- how -----------------------------------------------------------------------------

    def write(
        self,
        step: int,
        token: int,
        taken: tuple[Groups, dict[str, Any], dict[str, dict[str, str]]],
        *,
        final: bool,
        metrics: dict[str, float],
        staged: Path | None = None,
        began: float | None = None,
    ) -> None:
        """Capture a checkpoint (`state`'s) and hand it to the writer thread (with `staged`,
        a framework's own files: `baton.runtime.external`). `began` (`time.perf_counter()`)
        is when the loop stopped for it: taking the state (a sharded object's state dicts
        are built then) is part of the stall reported."""
        groups, meta, headers = taken
        try:
            snap, stalled = self._snap.capture(step, groups, meta, headers)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"ctx.cursor must hold only JSON values: {exc}") from None
        if began is not None:
            stalled = time.perf_counter() - began
        snap.staged = staged
        ready = CheckpointReady(
            step=snap.step, token=token, files=[], final=final, digest=meta.get("digest", ""),
            metrics=dict(metrics), stall_s=stalled, ranks=self._ranks(), sharded=self.sharded,
        )  # fmt: skip

        def failed(exc: BaseException) -> None:
            self.write_error = exc

        self._snap.write_async(
            snap, self.run_id, token, partial(self._written, ready), failed, self._vet
        )
        self.taken(step)

    def skip(self, step: int) -> bool:
        """Whether this rank writes nothing of a checkpoint of `step` (an elastic run's rank
        k >= 1 with nothing sharded), marking it taken if so."""
        if self.spec.elastic and self.rank > 0 and not self.sharded:
            self.taken(step)
            return True
        return False

    def _written(self, ready: CheckpointReady, files: list[FileRef]) -> None:
        """On the writer thread, once this rank's files are stored: another rank hands them
        to rank 0, whose writer sends them with its own, as one checkpoint."""
        if self._group is not None and self.rank > 0:
            self._group.publish_files(ready.step, files)
            return
        if self._group is not None and ready.ranks > 1:
            files = files + self._group.gather_files(ready.step)
        digest = ready.digest
        if self.slots and self.slots[0].sharded:
            digest = shard_digest(files, self.slots[0].name)
        self._send(msgspec.structs.replace(ready, files=files, digest=digest))

    def wait(self) -> None:
        """Until the checkpoint being written is stored (or its write failed)."""
        self._snap.wait()

    def raise_failed(self) -> None:
        if self.write_error is not None:
            raise RuntimeError("writing a checkpoint failed") from self.write_error

    def write_witness(self, key: str, data: bytes) -> None:
        self._snap.write_witness(key, data)

    def keep_local(self, step: int, cursor: dict[str, Any], token: int) -> None:
        """After a step: a local snapshot of it, if one is due (`baton.runtime.local`)."""
        local = self.local
        if local is not None and step < self.spec.total_steps and local.due():
            groups, meta, _ = self.state(step, cursor, digest=False)
            local.take(step, token, groups, meta)

    def drop_local(self) -> None:
        """Remove this run's local snapshots: the state since the last checkpoint is not to
        be resumed."""
        if self.local is not None:
            self.local.discard()
            self.local.on = False

    def close(self, completed: bool = False) -> None:
        self._snap.close()
        if self.local is not None and completed:  # nothing left to resume on this host
            self.local.discard()
        elif self.local is not None:
            self.local.close()
        self.raise_failed()

    def newest_commit(self, token: int) -> int:
        """The step of the store's `latest` if a commit under `token` put it there, else -1
        (and -1 when the store cannot be read): what a training process that missed the
        trainer's word on a commit can see for itself."""

        async def read() -> int:
            async with open_store(self.store_url) as store:
                latest = await commit.read_latest(store, self.run_id)
            return latest[0].step if latest is not None and latest[0].token == token else -1

        try:
            return asyncio.run(read())
        except Exception:
            return -1

    # -- resuming ------------------------------------------------------------------------

    async def find(self, witnessed: bool) -> Found:
        """The checkpoint to resume from: the newest that verifies, as rank 0 found it (a
        commit landing while the ranks look must not split them), and (`witnessed`) its
        witness."""
        async with open_store(self.store_url) as store:
            damaged: list[int] = []
            latest = None
            if self._group is not None and self.rank > 0:
                key = await asyncio.to_thread(self._group.shared, "restore")
                manifest = await chosen(store, key, self.run_id)
            else:
                latest = await commit.read_latest(store, self.run_id)
                manifest, damaged = await commit.restorable(store, self.run_id)
            if self._group is not None and self.rank == 0:
                self._group.share("restore", commit.key_of(manifest) if manifest else "")
            if manifest is not None:
                commit.check_ranks(manifest, self.world_size, self.spec.elastic)
            pointer = latest[0] if latest is not None else None
            if manifest is None or not witnessed:
                return Found(manifest, damaged, None, pointer)
            try:
                data = await store.get(commit.witness_key(self.run_id, manifest.step))
            except NotFound:
                return Found(manifest, damaged, None, pointer)
            return Found(manifest, damaged, witness.decode(data, manifest.step), pointer)

    def load(self, manifest: Manifest) -> Resumed:
        """Load a checkpoint that `commit.restorable` verified (`baton.runtime.load`)."""
        resumed = load(
            self.store_url, manifest, self.slots,
            run_id=self.run_id, spec_hash=spec_hash(self.spec),
            rank=0 if self.spec.elastic else self.rank, verify=self.rank > 0,
        )  # fmt: skip
        self.taken(resumed.step)
        return resumed

    def resume_local(self, latest: Pointer | None, behind: bool = False) -> Resumed | None:
        """Load this host's local snapshot, if it continues the store's chain at `latest`
        and is ahead of it (`baton.runtime.local`); None to resume from the store. `behind`:
        the attempt resumes from a checkpoint older than `latest` (the newer ones were
        damaged), which no snapshot continues."""
        local = self.local
        if local is not None and self.sharded:
            local.on = False  # a sharded object's chunks are a group's, not a host's
        if local is None or not local.on:
            return None
        found = local.find(latest, behind)
        if found is None:
            return None
        path, mark = found
        try:
            resumed = load_local(
                path, self.slots, mark.step, run_id=self.run_id, spec_hash=spec_hash(self.spec)
            )
        except IntegrityError as exc:
            print(f"baton: local snapshot {mark.step} not resumed: {exc}", file=sys.stderr)
            return None
        print(f"baton: resumed step {mark.step} from this host's local snapshot (the newest"
              f" checkpoint is step {latest.step if latest else 0})", file=sys.stderr)  # fmt: skip
        self.taken(resumed.step)
        self.resumed_local = True
        return resumed


def shard_digest(files: list[FileRef], name: str) -> str:
    """The digest of a sharded object: sha256 over its shard files' own sha256s, in rank
    order. Two runs at the same number of ranks have the same one exactly when their
    weights are the same bits; across sizes, compare gathered weights (`baton pull`)."""
    h = hashlib.sha256()
    for ref in sorted((f for f in files if group_of(f.name) == name), key=lambda f: f.name):
        h.update(f"{ref.name}:{ref.sha256}\n".encode())
    return h.hexdigest()
