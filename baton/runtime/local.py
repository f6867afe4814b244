"""Local snapshots: a run's newest state kept in its host's memory, outside the training
process, so an attempt killed between two checkpoints resumes on that host at the step it
had reached, not at the last commit.

A job asks for them (`checkpoint.local_every_seconds`); a run of one rank that owns its
loop (`ctx.restore()`, `ctx.steps()`) takes one after a step whenever that many seconds
have passed and the last one is written. Taking one costs the loop the copy of its state
into host buffers (as a checkpoint does); a thread writes it to `BATON_SNAPSHOTS`
(`/dev/shm/baton-<uid>` by default: memory, so it survives any process on the host but
not the host). Nothing is uploaded, committed or fenced by the store: a local snapshot is
a shortcut to a state the store's chain leads to, never a checkpoint.

**Invariant: a local snapshot is resumed only as a continuation of the store's chain.** It
records the `latest` pointer its attempt resumed from (`base`) and the attempt's first
token. It is resumed only while `latest` is still that pointer, or is a checkpoint that
attempt committed itself (a token of the attempt's, at or before the snapshot's step: an
attempt's history is one line). A commit by anyone else, a rollback (a new pointer whatever
manifest it names), a site's fence — and it is discarded; the store decides.

**A zombie cannot feed later attempts.** Each run has a slot, `<root>/<key>/`, that holds
`snap-<token>-<step>/` directories, each renamed into place whole. An attempt that resumes
claims the slot with its token (a `claim-<token>` file) before it looks; from then on,
snapshots of lower tokens are ignored and their writers stop, so a process that outlived
its lease on this host cannot hand its steps to anyone.

Best effort throughout: a snapshot that cannot be written (a full `/dev/shm`, no such
directory) turns local snapshots off for the attempt, with a line in the run's log; the
run goes on with its checkpoints. A run that completes removes its slot; a slot nobody
touched for `KEEP_S` (its run ended or moved to another host) is removed by the next
attempt on the host that looks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import save_file

from baton.runtime.snapshot import copy_into
from shared.checkpoint.files import META, SUFFIX
from shared.contracts import Pointer

KEEP_S = 3600.0
"""A slot untouched this long belongs to a run that ended or moved on; it is removed."""
MARK = "snapshot.json"

Groups = dict[str, dict[str, torch.Tensor]]


class Mark(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a local snapshot is a continuation of (its directory's `snapshot.json`)."""

    run_id: str
    step: int
    token: int
    """The token it was taken under."""
    first_token: int
    """The token its attempt started with (a lapsed lease re-taken raises it)."""
    base: Pointer | None
    """The store's `latest` when its attempt resumed; None for a run with none yet."""

    def continues(self, latest: Pointer | None) -> bool:
        """Whether resuming from it continues the chain that ends at `latest` (see the
        module's docstring), and is ahead of it."""
        if self.step <= (latest.step if latest is not None else 0):
            return False
        if latest == self.base:
            return True
        return (
            latest is not None
            and latest.checkpoint is not None
            and self.first_token <= latest.token <= self.token
        )


def root() -> Path:
    """Where local snapshots live: `BATON_SNAPSHOTS`, else shared memory if the host has it
    (Linux), else the temporary directory; one directory per user."""
    if given := os.environ.get("BATON_SNAPSHOTS"):
        return Path(given)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"baton-{os.getuid()}"


class LocalSnapshots:
    def __init__(self, root: Path, store_url: str, run_id: str, token: int, every_s: float) -> None:
        key = hashlib.sha256(f"{store_url}\n{run_id}".encode()).hexdigest()[:32]
        self.root = root
        self.slot = root / key
        """This run's, of this store: two stores may hold runs of the same id."""
        self.run_id = run_id
        self.first_token = token
        self.every_s = every_s
        self.base: Pointer | None = None
        self.on = True
        self._buffers: dict[str, torch.Tensor] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-local")
        self._pending: concurrent.futures.Future[None] | None = None
        self._last = time.monotonic()

    # -- resuming ------------------------------------------------------------------------

    def find(self, latest: Pointer | None, behind: bool = False) -> tuple[Path, Mark] | None:
        """Claim the slot for this attempt, then the newest snapshot in it that continues
        the chain ending at `latest` (None: none does, and the slot is emptied). Called
        once, as the attempt resumes; `latest` becomes every later snapshot's base —
        unless the attempt resumes `behind` it (the checkpoints after were damaged): then
        none is resumed, and this attempt's continue only what it commits itself."""
        self.base = None if behind else latest
        try:
            self._sweep()
            self.slot.mkdir(parents=True, exist_ok=True, mode=0o700)
            fence = self._fence()  # as it was before this attempt: its own claim is higher
            (self.slot / f"claim-{self.first_token}").touch()
            for half in self.slot.glob(".tmp-*"):  # an attempt killed while writing one
                shutil.rmtree(half, ignore_errors=True)
            found = [(t, s, p) for t, s, p in self._snapshots() if t >= fence]
            if not found:
                return None
            *_, path = max(found)
            mark = msgspec.json.decode((path / MARK).read_bytes(), type=Mark)
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._off(f"cannot read this host's local snapshots: {exc}")
            return None
        if mark.run_id == self.run_id and not behind and mark.continues(latest):
            return path, mark
        self._clear(below=None)
        return None

    # -- taking --------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether to take one now: the interval passed and the last one is written."""
        return (
            self.on
            and time.monotonic() - self._last >= self.every_s
            and (self._pending is None or self._pending.done())
        )

    def take(self, step: int, token: int, groups: Groups, meta: dict[str, Any]) -> None:
        """Copy the state of `step` (`Checkpoints.state`'s) and write it on the thread."""
        self._last = time.monotonic()
        copies = copy_into(self._buffers, groups)
        encoded = json.dumps(meta, sort_keys=True).encode()
        mark = Mark(
            run_id=self.run_id, step=step, token=token, first_token=self.first_token,
            base=self.base,
        )  # fmt: skip
        self._pending = self._pool.submit(self._write, mark, copies, encoded)

    def wait(self) -> None:
        """Until the snapshot being written is written (or given up)."""
        if self._pending is not None:
            self._pending.result()

    def discard(self) -> None:
        """The run completed: nothing here will be resumed."""
        self.close()
        shutil.rmtree(self.slot, ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- internals -----------------------------------------------------------------------

    def _write(self, mark: Mark, groups: Groups, meta: bytes) -> None:
        try:
            if self._fence() > mark.token:
                self._off("another attempt resumed this run on this host")
                return
            tmp = self.slot / f".tmp-{mark.token}-{mark.step}-{os.getpid()}"
            tmp.mkdir(parents=True, mode=0o700)
            try:
                for group, tensors in groups.items():
                    save_file(tensors, str(tmp / f"{group}{SUFFIX}"))
                (tmp / META).write_bytes(meta)
                (tmp / MARK).write_bytes(msgspec.json.encode(mark))
                tmp.rename(self.slot / _name(mark.token, mark.step))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._clear(below=(mark.token, mark.step))
        except OSError as exc:
            self._off(f"cannot write a local snapshot to {self.slot}: {exc}")

    def _snapshots(self) -> list[tuple[int, int, Path]]:
        out = []
        for path in self.slot.iterdir():
            parts = path.name.split("-")
            if len(parts) == 3 and parts[0] == "snap" and parts[1].isdigit() and parts[2].isdigit():
                out.append((int(parts[1]), int(parts[2]), path))
        return out

    def _fence(self) -> int:
        claims = [p.name.removeprefix("claim-") for p in self.slot.glob("claim-*")]
        return max((int(c) for c in claims if c.isdigit()), default=0)

    def _clear(self, below: tuple[int, int] | None) -> None:
        """Remove the snapshots older than `below` (all of them: None)."""
        with contextlib.suppress(OSError):
            for token, step, path in self._snapshots():
                if below is None or (token, step) < below:
                    shutil.rmtree(path, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove other runs' slots nobody touched for `KEEP_S`."""
        if not self.root.is_dir():
            return
        cutoff = time.time() - KEEP_S
        for slot in self.root.iterdir():
            with contextlib.suppress(OSError):
                if slot != self.slot and slot.stat().st_mtime < cutoff:
                    shutil.rmtree(slot, ignore_errors=True)

    def _off(self, why: str) -> None:
        if self.on:
            print(f"baton: local snapshots off: {why}", file=sys.stderr)
        self.on = False


def _name(token: int, step: int) -> str:
    return f"snap-{token:020d}-{step:020d}"
