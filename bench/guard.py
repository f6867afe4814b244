"""What the divergence guard's tensor check costs, as ratios against baselines measured in
the same run.

1. The check itself (`baton.runtime.guard.Watch.checked`: `isfinite` over every floating
   tensor of a checkpoint) against copying the same bytes into preallocated host buffers —
   the checkpoint stall's floor (`bench.checkpoint`). This is why the check runs on the
   writer thread and not in the training loop.
2. The writer thread's time per checkpoint (serialise, hash, write to a `file://` store)
   with the check against without it: what the check adds to the background write.

    .venv/bin/python -m bench.guard [--sizes 10,100,1000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from baton.runtime.guard import Watch
from baton.runtime.snapshot import Snapshot, Snapshotter
from bench.checkpoint import copy_bandwidth
from shared.contracts.jobs import Guard


def state(size_mb: int) -> dict[str, dict[str, torch.Tensor]]:
    n = size_mb * 1024 * 1024 // 4
    return {"model": {f"w{i}": torch.randn(n // 8) for i in range(8)}}


def check_vs_copy(size_mb: int, repeats: int = 3) -> tuple[float, float]:
    """(median check s, ideal copy s) for a state of `size_mb`."""
    groups = state(size_mb)
    watch = Watch(Guard())
    copy = sum(t.numel() * 4 for t in groups["model"].values()) / copy_bandwidth(groups["model"])
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        assert watch.checked(1, groups) is None
        times.append(time.perf_counter() - began)
    return statistics.median(times), copy


def write(size_mb: int, store: Path, vetted: bool, repeats: int = 3) -> float:
    """Median seconds the writer thread spends per checkpoint, with or without the check."""
    groups = state(size_mb)
    snap = Snapshotter(f"file://{store}", store / ".spool")
    watch = Watch(Guard())
    times = []
    written: list[int] = []

    def vet(s: Snapshot) -> bool:
        return watch.checked(s.step, s.groups) is None

    for step in range(1, repeats + 1):
        captured, _ = snap.capture(step, groups, {"step": step})
        began = time.perf_counter()
        snap.write_async(
            captured, f"bench-{vetted}", step, lambda files: written.append(len(files)),
            lambda exc: None, vet if vetted else None,
        )  # fmt: skip
        snap.wait()
        times.append(time.perf_counter() - began)
    assert len(written) == repeats, "a checkpoint was not written"
    snap.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="state sizes, MB")
    args = parser.parse_args()
    print("| state | check | copy baseline | ratio | write | write + check | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mb in (int(s) for s in args.sizes.split(",")):
        check, copy = check_vs_copy(mb)
        with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
            plain = write(mb, Path(tmp) / "a", vetted=False)
            vetted = write(mb, Path(tmp) / "b", vetted=True)
        print(
            f"| {mb} MB | {check * 1e3:.1f} ms | {copy * 1e3:.1f} ms | {check / copy:.1f} "
            f"| {plain * 1e3:.0f} ms | {vetted * 1e3:.0f} ms | {vetted / plain:.2f} |"
        )


if __name__ == "__main__":
    main()
