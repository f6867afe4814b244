"""Timings of Baton's own checkpoint path, taken inside a training process by wrapping the
functions that do the work (nothing of Baton's is changed):

* `RunContext._save`: how long the training loop is blocked for a checkpoint (its stall);
* within it, `weights_digest` (the run's digest, taken of the weights on the loop's thread),
  `Snapshotter.wait` (for the previous write) and `copy_into` (the device-to-host copy into
  the reused host buffers; whether they are pinned and the source on the GPU);
* on the writer thread, `Snapshotter._write` (serialise, hash, store): its throughput.

Also the limit a snapshot's copy is held to: the same tensors copied into preallocated
host buffers (pinned for a GPU's), `non_blocking`, one synchronisation at the end.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
import torch

F = TypeVar("F", bound=Callable[..., Any])


class Copy(msgspec.Struct, frozen=True, kw_only=True):
    seconds: float
    bytes: int
    pinned: bool
    """Every host buffer it copied into is pinned (page-locked) memory."""
    from_gpu: bool


class Save(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    final: bool
    stall_s: float
    digest_s: float
    wait_s: float
    copy_s: float


class Probe:
    def __init__(self) -> None:
        self.copies: list[Copy] = []
        self.saves: list[Save] = []
        self.writes: list[tuple[float, int]] = []
        """(seconds, bytes) of each write finished on the writer thread."""
        self._lock = threading.Lock()
        self._digest = self._wait = 0.0

    def install(self) -> None:
        """Wrap Baton's functions in this process (a training process of the proofs)."""
        from baton.runtime import checkpoints, context, snapshot

        snapshot.copy_into = self._timed_copy(snapshot.copy_into)
        # Looked up in the module at each call: the digest the loop takes of the weights.
        digest = checkpoints.weights_digest  # type: ignore[attr-defined]
        setattr(checkpoints, "weights_digest", self._timed(digest, "_digest"))  # noqa: B010
        snapshot.Snapshotter.wait = self._timed(snapshot.Snapshotter.wait, "_wait")  # type: ignore[method-assign]
        snapshot.Snapshotter._write = self._timed_write(snapshot.Snapshotter._write)  # type: ignore[method-assign]
        context.RunContext._save = self._timed_save(context.RunContext._save)  # type: ignore[method-assign]

    @property
    def written(self) -> int:
        with self._lock:
            return len(self.writes)

    def _timed(self, fn: F, into: str) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - began)

        return timed  # type: ignore[return-value]

    def _timed_copy(self, fn: F) -> F:
        @functools.wraps(fn)
        def copy_into(buffers: Any, groups: dict[str, dict[str, torch.Tensor]]) -> Any:
            began = time.perf_counter()
            out = fn(buffers, groups)
            took = time.perf_counter() - began
            bufs = [b for g in out.values() for b in g.values()]
            sources = [t for g in groups.values() for t in g.values()]
            self.copies.append(
                Copy(
                    seconds=took, bytes=sum(b.numel() * b.element_size() for b in bufs),
                    pinned=all(b.is_pinned() for b in bufs if b.numel()),
                    from_gpu=any(t.is_cuda for t in sources),
                )
            )  # fmt: skip
            return out

        return copy_into  # type: ignore[return-value]

    def _timed_write(self, fn: F) -> F:
        @functools.wraps(fn)
        def _write(snapshotter: Any, snap: Any, run_id: str, token: int) -> Any:
            began = time.perf_counter()
            files = fn(snapshotter, snap, run_id, token)
            with self._lock:
                self.writes.append((time.perf_counter() - began, sum(f.size for f in files)))
            return files

        return _write  # type: ignore[return-value]

    def _timed_save(self, fn: F) -> F:
        @functools.wraps(fn)
        def _save(ctx: Any, final: bool) -> Any:
            self._digest = self._wait = 0.0
            copies = len(self.copies)
            began = time.perf_counter()
            out = fn(ctx, final)
            took = time.perf_counter() - began
            if len(self.copies) > copies:  # a checkpoint was taken (not a repeat of one)
                self.saves.append(
                    Save(
                        step=ctx.step, final=final, stall_s=took, digest_s=self._digest,
                        wait_s=self._wait, copy_s=self.copies[-1].seconds,
                    )
                )  # fmt: skip
            return out

        return _save  # type: ignore[return-value]


def state_tensors(*objects: Any) -> list[torch.Tensor]:
    """Every tensor of the objects' state dicts (a model's, an optimizer's), as a checkpoint
    copies them."""
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    for obj in objects:
        walk(obj.state_dict())
    return out


def pinned_limit(tensors: Iterable[torch.Tensor], repeats: int = 3) -> float:
    """Median seconds to copy `tensors` into host buffers allocated once (pinned for a GPU's
    tensors), each copy `non_blocking`, one synchronisation at the end: the floor for any
    snapshot of them. The first copy touches the buffers and is not counted."""
    tensors = [t.detach() for t in tensors]
    gpu = any(t.is_cuda for t in tensors)
    bufs = [
        torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda) for t in tensors
    ]
    times = []
    for i in range(repeats + 1):
        began = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t, non_blocking=t.is_cuda)
        if gpu:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - began)
    del bufs
    if gpu and (empty := getattr(torch._C, "_host_emptyCache", None)) is not None:
        empty()  # the snapshot allocates its own buffers, as it would without this probe
    return statistics.median(times)
