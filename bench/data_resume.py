"""What resuming a data position costs: the time to the first batch after a mid-epoch resume,
and how many items are read to get it, with Baton's `Batches` against two hand-rolled skips.
Ratios are against a baseline measured in the same run.

    .venv/bin/python bench/data_resume.py [--batches 400] [--batch-size 32]
                                          [--offsets 0,25,50,90] [--workers 0,2]
                                          [--item-ms 0.2] [--work decode|sleep] [--repeat 5]

The dataset is map-style; each `__getitem__` costs a fixed amount of work and is counted in
a `multiprocessing.Value` that the loader's worker processes share. By default the work is
decode-like CPU work: a 3×32×32 image compressed with zlib (PNG's codec) is decompressed as
many times as take `--item-ms` here, calibrated at start. CPU work, because decoding is what
a local dataset pays per item and what a skip that reads the data competes for cores with;
`--work sleep` sleeps `--item-ms` instead, an I/O-bound fetch that does not load the CPU.

For each number of workers, an uninterrupted `Batches` (seed 0) is iterated once through the
largest offset; at each offset its `state_dict()` is kept (deep-copied, as a checkpoint holds
it) with the batch it yields next. Then, for each offset, the time from building the loader
to holding the first batch after the offset:

* (a) Baton: a fresh `Batches`, `load_state_dict()` with the kept state, `next()`.
* (b) naive: a plain `torch.utils.data.DataLoader` over a seeded permutation, its first
  `offset` batches iterated (read, collated, thrown away) before the one wanted.
* (c) index skip: a plain `DataLoader` whose batch sampler drops its first `offset` batches of
  indices without reading them, the hand-rolled equivalent of torchdata's fast-forward.

The baselines shuffle with `torch.randperm(n)` drawn from a generator seeded like Baton's,
given to the loader as its sampler (a hand-rolled resume must regenerate its permutation, so
it holds it). That is not `StatefulDataLoader`'s order for the same seed: it draws the
permutation at another point of the generator's sequence (another one again with workers),
which changes what comes first but not what a skip costs. So each way is checked against its
own uninterrupted order: (a)'s first batch must equal what the uninterrupted `Batches`
yielded at that offset, (b)'s and (c)'s the batch at that offset of their permutation.
Items read are counted until the first batch is in hand; with workers that includes what
they had prefetched by then (up to `prefetch_factor` × workers batches in flight).

The three ways take turns, each measured `--repeat` times (median), except that a way stops
repeating once its measurements add up to 1 s: the naive skip deep into an epoch is measured
once or twice. (a)/(c) is Baton against the cheapest hand-rolled resume, (b)/(a) what Baton
saves over re-reading.
"""

from __future__ import annotations

import argparse
import copy
import gc
import multiprocessing
import os
import resource
import statistics
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, default_collate

from baton.runtime.data import Batches

SEED = 0
REPEAT_BUDGET_S = 1.0
IMAGE = (3, 32, 32)

Item = tuple[torch.Tensor, int]


class Decoded(Dataset[Item]):
    """`size` items, each a 3×32×32 uint8 image and its index; `__getitem__` decompresses a
    zlib-compressed image `reps` times (or sleeps `sleep_s`, then decompresses it once) and
    counts itself in `reads`."""

    def __init__(self, size: int, reps: int, sleep_s: float, reads: Any) -> None:
        self.size = size
        self.reps = reps
        self.sleep_s = sleep_s
        self.reads = reads
        self.blob = zlib.compress(image_bytes(), 6)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Item:
        with self.reads.get_lock():
            self.reads.value += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
            raw = zlib.decompress(self.blob)
        else:
            for _ in range(self.reps):
                raw = zlib.decompress(self.blob)
        img = np.frombuffer(raw, dtype=np.uint8).reshape(IMAGE)
        return torch.from_numpy(np.roll(img, i)), i


def image_bytes() -> bytes:
    """A photo-like image: smooth gradients plus noise, so it compresses as images do."""
    rng = np.random.default_rng(SEED)
    c, h, w = IMAGE
    base = np.add.outer(np.arange(h), np.arange(w)) * 4 + np.arange(c)[:, None, None] * 40
    noise = rng.integers(0, 24, size=IMAGE)
    return ((base + noise) % 256).astype(np.uint8).tobytes()


def calibrate(item_ms: float) -> tuple[int, float]:
    """How many decompressions of the image take `item_ms` here, and what one item then
    costs (the median of 200, in ms)."""
    blob = zlib.compress(image_bytes(), 6)

    def best(reps: int, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            for _ in range(reps):
                zlib.decompress(blob)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    one = min(best(1000, 5)) / 1000  # ms per decompression, the timer's cost spread thin
    reps = max(1, round(item_ms / one))
    return reps, statistics.median(best(reps, 200))


class SkipBatches(Sampler[list[int]]):
    """A batch sampler that drops the first `skip` batches of indices: no item is read."""

    def __init__(self, batches: BatchSampler, skip: int) -> None:
        self.batches = batches
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.batches)
        for _ in range(self.skip):
            next(it)
        yield from it

    def __len__(self) -> int:
        return len(self.batches) - self.skip


@dataclass
class Row:
    workers: int
    offset: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    reads: dict[str, list[int]] = field(default_factory=dict)

    def s(self, way: str) -> float:
        return statistics.median(self.seconds[way])

    def n(self, way: str) -> int:
        return round(statistics.median(self.reads[way]))


def same(got: Any, want: Any) -> bool:
    return (
        len(got) == len(want) == 2 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    )


def capture(
    ds: Decoded, batch_size: int, workers: int, offsets: list[int]
) -> dict[int, tuple[dict[str, Any], Any]]:
    """Iterate one uninterrupted `Batches` to the largest offset; at each offset, the state
    it would checkpoint there and the batch it yields next."""
    kept: dict[int, tuple[dict[str, Any], Any]] = {}
    batches = Batches(ds, batch_size=batch_size, seed=SEED, num_workers=workers)
    for k in range(max(offsets) + 1):
        state = copy.deepcopy(batches.state_dict()) if k in offsets else None
        batch = next(batches)
        if state is not None:
            kept[k] = (state, batch)
    del batches
    gc.collect()
    return kept


def timed(ds: Decoded, first_batch: Callable[[], tuple[Any, object]]) -> tuple[float, int, Any]:
    """(seconds to the first batch, items read by then, the batch). The loader is shut down
    (its workers joined) after the clock stops: a resumed run keeps it."""
    gc.collect()
    ds.reads.value = 0
    t0 = time.perf_counter()
    batch, loader = first_batch()
    seconds = time.perf_counter() - t0
    reads = int(ds.reads.value)
    del loader
    gc.collect()
    return seconds, reads, batch


def measure(
    ds: Decoded,
    perm: list[int],
    batch_size: int,
    workers: int,
    offset: int,
    state: dict[str, Any],
) -> dict[str, Callable[[], tuple[Any, object]]]:
    """The three ways to the first batch after `offset`, each building its own loader; each
    returns the batch and what holds the loader."""

    def baton() -> tuple[Any, object]:
        batches = Batches(ds, batch_size=batch_size, seed=SEED, num_workers=workers)
        batches.load_state_dict(state)
        return next(batches), batches

    def naive() -> tuple[Any, object]:
        loader = DataLoader(ds, batch_size=batch_size, sampler=perm, num_workers=workers)
        it = iter(loader)
        for _ in range(offset):
            next(it)  # read, collated and thrown away
        return next(it), it

    def index_skip() -> tuple[Any, object]:
        skip = SkipBatches(BatchSampler(perm, batch_size, drop_last=False), offset)
        it = iter(DataLoader(ds, batch_sampler=skip, num_workers=workers))
        return next(it), it

    return {"a": baton, "b": naive, "c": index_skip}


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU time the whole machine has been busy, CPU time this process and its reaped
    children used), in seconds; None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, sum(r.ru_utime + r.ru_stime for r in own)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--batches", type=int, default=400, help="batches in an epoch")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--offsets", default="0,25,50,90", help="resume points, %% of an epoch")
    ap.add_argument("--workers", default="0,2", help="num_workers values to measure")
    ap.add_argument("--item-ms", type=float, default=0.2, help="work per __getitem__, ms")
    ap.add_argument("--work", choices=("decode", "sleep"), default="decode")
    ap.add_argument(
        "--repeat",
        type=int,
        default=5,
        help=f"measurements per cell (median); fewer once one way has taken {REPEAT_BUDGET_S:g} s",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    # torchdata 0.11's StatefulDataLoader calls an API torch deprecated; nothing of ours.
    warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
    offsets = sorted({a.batches * int(p) // 100 for p in a.offsets.split(",") if p})
    if max(offsets) >= a.batches:
        ap.error("every offset must lie inside the epoch (below 100 %)")
    workers = [int(w) for w in a.workers.split(",") if w]
    size = a.batches * a.batch_size
    if a.work == "decode":
        reps, item_ms = calibrate(a.item_ms)
        work = f"decode: zlib image ×{reps}, {item_ms:.3f} ms per item measured here, idle"
    else:
        reps, item_ms = 1, a.item_ms
        work = f"sleep {item_ms:g} ms (+ one zlib image decode) per item"
    reads = multiprocessing.Value("q", 0)
    ds = Decoded(size, reps, a.item_ms / 1e3 if a.work == "sleep" else 0.0, reads)
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(SEED)).tolist()
    print(
        f"{a.batches} batches of {a.batch_size} ({size} items); {work}; "
        f"offsets {offsets}; workers {workers}; median of {a.repeat} (or of as many as fill "
        f"{REPEAT_BUDGET_S:g} s)",
        flush=True,
    )
    # Batch k of the baselines' permutation, read directly: what (b) and (c) must yield.
    plain = {
        k: default_collate([ds[i] for i in perm[k * a.batch_size : (k + 1) * a.batch_size]])
        for k in offsets
    }
    gc.freeze()  # what exists now is never garbage: the collections between measurements skip it
    t_start, cpu_start = time.perf_counter(), cpu_seconds()
    rows: list[Row] = []
    for w in workers:
        t0 = time.perf_counter()
        kept = capture(ds, a.batch_size, w, offsets)
        print(
            f"  workers {w}: uninterrupted run to batch {max(offsets)} took "
            f"{time.perf_counter() - t0:.2f} s",
            flush=True,
        )
        for k in offsets:
            state, want = kept[k]
            row = Row(w, k)
            ways = measure(ds, perm, a.batch_size, w, k, state)
            for _ in range(a.repeat):
                for way, first_batch in ways.items():
                    if sum(row.seconds.get(way, [])) >= REPEAT_BUDGET_S:
                        continue  # a long measurement is its own average
                    seconds, n, got = timed(ds, first_batch)
                    expect = want if way == "a" else plain[k]
                    assert same(got, expect), (
                        f"({way}) workers {w}, offset {k}: the first batch after the resume "
                        f"is items {got[1][:4].tolist()}…, the uninterrupted order's is "
                        f"{expect[1][:4].tolist()}…"
                    )
                    row.seconds.setdefault(way, []).append(seconds)
                    row.reads.setdefault(way, []).append(n)
            rows.append(row)
            print(
                f"  workers {w}, offset {k}: (a) {row.s('a') * 1e3:.1f} ms, "
                f"(b) {row.s('b') * 1e3:.1f} ms, (c) {row.s('c') * 1e3:.1f} ms; checked",
                flush=True,
            )
    print()
    print(table(rows, a.batches))
    print(
        "\n(a) Baton: Batches + load_state_dict; (b) naive: plain DataLoader, offset batches "
        "read and dropped;\n(c) index skip: plain DataLoader, offset batches of indices "
        "dropped unread. Items: __getitem__ calls\nuntil the first batch was in hand. Every "
        "first batch equalled its uninterrupted order's at that offset."
    )
    wall = time.perf_counter() - t_start
    cpu_end = cpu_seconds()
    others = ""
    if cpu_start is not None and cpu_end is not None:
        other_s = (cpu_end[0] - cpu_start[0]) - (cpu_end[1] - cpu_start[1])
        cores = os.cpu_count() or 1
        others = (
            f"; other processes used {max(0.0, other_s):.1f} CPU-s of the machine's "
            f"{cores * wall:.0f} ({100 * max(0.0, other_s) / (cores * wall):.0f} %)"
        )
    print(f"total {wall:.1f} s{others}")
    return 0


def table(rows: list[Row], epoch: int) -> str:
    head = (
        f"{'workers':>7} {'offset':>10} {'(a) ms':>8} {'items':>6} {'(b) ms':>8} {'items':>6}"
        f" {'(c) ms':>8} {'items':>6} {'(a)/(c)':>8} {'(b)/(a)':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        where = f"{r.offset} ({100 * r.offset // epoch}%)"
        lines.append(
            f"{r.workers:>7} {where:>10} {r.s('a') * 1e3:>8.1f} {r.n('a'):>6}"
            f" {r.s('b') * 1e3:>8.1f} {r.n('b'):>6} {r.s('c') * 1e3:>8.1f} {r.n('c'):>6}"
            f" {r.s('a') / r.s('c'):>8.2f} {r.s('b') / r.s('a'):>8.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
