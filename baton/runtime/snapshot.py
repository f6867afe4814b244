"""Asynchronous checkpoints: the training loop waits only for a copy into host memory.

The copy goes into buffers allocated once and reused (pinned when the source is on a GPU),
because copying into fresh allocations is several times slower than into warm memory
(docs/nats.md: 5.4 GB/s vs far less). Serialising, hashing and uploading happen on
one background thread, so at most one checkpoint is in flight and memory stays bounded.

A capture overwrites the buffers, so it must wait for the previous write; what happens when
a checkpoint comes due while a write is still in flight depends on who wants it:

* A periodic checkpoint (the job's policy) does not wait: `RunContext` sees `busy` and
  postpones it to the first step after the write has finished. Waiting would stall training
  for as long as the store is slow or down, and the newer checkpoint could not be uploaded
  any sooner anyway; postponing rather than skipping means none is silently dropped.
  `every_seconds` counts again from the postponed checkpoint; `every_steps` stays on its
  multiples.
* A forced one (final, stop/preemption, `ctx.checkpoint()`, the trainer's request) waits:
  its caller needs exactly that step saved, and the buffers must be free to hold it. During
  an outage that wait lasts until the store is back (or the trainer's grace period ends).

The writer outlasts a store outage: an upload that fails transiently is retried with capped
exponential back-off for as long as it takes. That is safe because every file goes to a key
of its own (run, token, step, name) that nothing else writes; if an attempt whose answer was
lost did land, the write-once refusal is settled by reading the key back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.backoff import Backoff
from shared.checkpoint.commit import data_key
from shared.checkpoint.files import FILE_PREFIX
from shared.checkpoint.store import Store, open_store
from shared.checkpoint.store.base import sha256_file
from shared.contracts import FileRef
from shared.errors import AlreadyExists, TransientError

log = logging.getLogger("baton.runtime.snapshot")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
"""Back-off between upload attempts while the store is down. The cap bounds how long a
checkpoint sits idle after the store is back; the store client retries within each attempt."""

# Connection-level OSErrors only: a missing spool file or a full disk is not an outage.
_OUTAGE = (TransientError, ConnectionError, TimeoutError)


class Snapshot:
    """One checkpoint's worth of host-memory copies, ready to be written: buffers the next
    capture will not touch before this one is written, and meta.json already serialised.
    Nothing in it refers to an object the training loop goes on changing."""

    def __init__(
        self,
        step: int,
        groups: dict[str, dict[str, torch.Tensor]],
        meta: bytes,
        headers: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.step = step
        self.groups = groups
        self.meta = meta
        self.headers = headers or {}
        """A group's safetensors `__metadata__`: a sharded object's chunk offsets."""
        self.staged: Path | None = None
        """A directory of a framework's own files to store too, each as `file.<name>`
        (`baton.runtime.external`): the snapshot's own copies, removed once written."""


class Snapshotter:
    def __init__(self, store_url: str, spool: Path, prefix: str = "") -> None:
        self._store_url = store_url
        self._spool = spool
        self._prefix = prefix
        """Put before every file name: a rank's own shard (`rank1.`), "" for rank 0. Ranks
        on one host share the spool directory, so it keeps their files apart there too."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-ckpt")
        self._pending: concurrent.futures.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: Store | None = None
        self._outage_since: float | None = None

    @property
    def busy(self) -> bool:
        """Whether a write is still in flight (a capture now would wait for it)."""
        return self._pending is not None and not self._pending.done()

    def capture(
        self,
        step: int,
        groups: dict[str, dict[str, torch.Tensor]],
        meta: dict[str, object],
        headers: dict[str, dict[str, str]] | None = None,
    ) -> tuple[Snapshot, float]:
        """Copy tensors into the reusable host buffers and serialise `meta`, both before
        returning: whatever the caller does next cannot reach the snapshot. Returns it and
        how long the caller was blocked (waiting for the previous write plus the copy)."""
        started = time.perf_counter()
        self.wait()
        copies = copy_into(self._buffers, groups)
        encoded = json.dumps(meta, sort_keys=True).encode()
        return Snapshot(step, copies, encoded, headers), time.perf_counter() - started

    def write_async(
        self,
        snap: Snapshot,
        run_id: str,
        token: int,
        done: Callable[[list[FileRef]], None],
        failed: Callable[[BaseException], None],
        vet: Callable[[Snapshot], bool] | None = None,
    ) -> None:
        """Write `snap` on the writer thread, then `done(files)`; `failed(exc)` instead if it
        raised. `vet`, when given, looks at the snapshot first, on the writer thread: a False
        leaves it unwritten, and neither is called."""

        def job() -> None:
            try:
                if vet is None or vet(snap):
                    done(self._write(snap, run_id, token))
            except BaseException as exc:
                failed(exc)

        self._pending = self._pool.submit(job)

    def write_witness(self, key: str, data: bytes) -> None:
        """Write a witness (`baton.runtime.witness`) once, after the writes queued before it. Best
        effort: a witness that cannot be written costs a check, never the run."""

        def job() -> None:
            store = self._open()
            assert self._loop is not None
            try:
                self._loop.run_until_complete(store.put_once(key, data))
            except AlreadyExists:
                pass  # another attempt passed these steps first; either is the witness
            except Exception as exc:
                log.warning("witness %s not written: %r", key, exc)

        self._pool.submit(job)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        if self._loop is not None and self._store is not None:
            self._pool.submit(self._loop.run_until_complete, self._store.close()).result()
        self._pool.shutdown()

    def _open(self) -> Store:
        # On the single writer thread, which owns its own event loop and store client.
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._store = open_store(self._store_url)
        assert self._store is not None
        return self._store

    def _write(self, snap: Snapshot, run_id: str, token: int) -> list[FileRef]:
        self._open()
        self._spool.mkdir(parents=True, exist_ok=True)
        files: list[tuple[str, Path]] = []
        for group, tensors in snap.groups.items():
            name = f"{self._prefix}{group}.safetensors"
            save_file(tensors, str(self._spool / name), metadata=snap.headers.get(group))
            files.append((name, self._spool / name))
        meta_name = f"{self._prefix}meta.json"
        (self._spool / meta_name).write_bytes(snap.meta)
        files.append((meta_name, self._spool / meta_name))
        if snap.staged is not None:
            for path in sorted(snap.staged.iterdir()):
                files.append((f"{self._prefix}{FILE_PREFIX}{path.name}", path))
        refs = []
        for name, path in files:
            size, digest = sha256_file(path)
            key = data_key(run_id, token, snap.step, name)
            self._put(key, path, size, digest)
            refs.append(FileRef(name=name, key=key, size=size, sha256=digest))
        if snap.staged is not None:
            shutil.rmtree(snap.staged, ignore_errors=True)
        return refs

    def _put(self, key: str, path: Path, size: int, digest: str) -> None:
        assert self._loop is not None and self._store is not None
        delays = Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        failed_before = False
        while True:
            try:
                self._loop.run_until_complete(
                    _upload(self._store, key, path, (size, digest), failed_before)
                )
            except _OUTAGE as exc:
                failed_before = True
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    log.warning("store unreachable (%s); retrying %s until it is back", exc, key)
                # back-off on the writer thread; training goes on meanwhile
                time.sleep(delays.next())
                continue
            if self._outage_since is not None:
                log.warning(
                    "store is back after %.1f s; uploaded %s",
                    time.monotonic() - self._outage_since,
                    key,
                )
                self._outage_since = None
            return


def copy_into(
    buffers: dict[str, torch.Tensor], groups: dict[str, dict[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Copy `groups`' tensors into host buffers kept in `buffers` (by group and name) and
    reused from one capture to the next (pinned when the source is on a GPU); returns the
    copies, grouped as given, once every copy is done."""
    copies: dict[str, dict[str, torch.Tensor]] = {}
    on_gpu = False
    for group, tensors in groups.items():
        out = copies[group] = {}
        for name, t in tensors.items():
            key = f"{group}/{name}"
            buf = buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                buffers[key] = buf
            out[name] = buf
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
            on_gpu = on_gpu or t.is_cuda
    if on_gpu:
        torch.cuda.synchronize()
    return copies


async def _upload(
    store: Store, key: str, path: Path, expected: tuple[int, str], retried: bool
) -> None:
    try:
        await store.put_file(key, path)
    except (AlreadyExists, FileNotFoundError):
        # Only an earlier attempt of ours can have written this key (a store may take the
        # spool file with it), and if one did, the bytes are ours. With no earlier attempt
        # the key is someone else's, or the file was never there: fail as before.
        if not retried or await store.stat(key) != expected:
            raise
