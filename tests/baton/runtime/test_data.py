"""Data positions resume exactly: torchdata's StatefulDataLoader registered through
`restore()` alone (its generator included), and `ctx.data_loader()`, mid-epoch and across
epoch boundaries, with and without worker processes — and without reading again what the
epoch had already read. In a run of several ranks, each rank's share of every epoch is its
own, and resumes as exactly."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from baton.runtime.context import RunContext
from baton.runtime.data import Batches
from baton.runtime.slots import slot_for
from tests.baton.harness import Run, spec

EPOCH = 5  # batches of 4 over 20 items


class Items(Dataset[torch.Tensor]):
    """Item i is i; counts the reads made in this process."""

    def __init__(self, n: int = 20) -> None:
        self.n = n
        self.reads = multiprocessing.Value("i", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.reads.get_lock():
            self.reads.value += 1
        return torch.tensor(i)


def forever(loader: StatefulDataLoader) -> Iterator[Any]:
    """Epoch after epoch, each iterator made when its first batch is drawn."""
    while True:
        yield from loader


Seen = list[list[int]]


def torchdata_loop(workers: int, seen: list[Seen]) -> Callable[[RunContext], Callable[[int], None]]:
    def setup(ctx: RunContext) -> Callable[[int], None]:
        g = torch.Generator().manual_seed(ctx.seed)
        loader = StatefulDataLoader(Items(), batch_size=4, shuffle=True, generator=g,
                                    num_workers=workers)  # fmt: skip
        batches = forever(loader)
        mine: Seen = []
        seen.append(mine)
        ctx.restore(model=torch.nn.Linear(1, 1), loader=loader)

        def body(step: int) -> None:
            mine.append(next(batches).tolist())

        return body

    return setup


def baton_loop(
    workers: int, seen: list[Seen], reads: list[Items] | None = None
) -> Callable[[RunContext], Callable[[int], None]]:
    def setup(ctx: RunContext) -> Callable[[int], None]:
        items = Items()
        if reads is not None:
            reads.append(items)
        batches = ctx.data_loader(items, batch_size=4, num_workers=workers)
        mine: Seen = []
        seen.append(mine)
        ctx.restore(model=torch.nn.Linear(1, 1))

        def body(step: int) -> None:
            mine.append(next(batches).tolist())
            ctx.cursor["epoch"] = batches.epoch

        return body

    return setup


LOOPS = {"torchdata": torchdata_loop, "baton": baton_loop}


@pytest.mark.parametrize("loop", ["torchdata", "baton"])
@pytest.mark.parametrize(
    ("workers", "committed", "died"),
    [(0, 7, 9), (0, 5, 12), (0, 8, 13), (2, 7, 12)],
    ids=["mid-epoch", "at-the-boundary", "across-the-boundary", "2-workers-across"],
)
def test_a_data_loader_resumes_at_exactly_the_next_batch(
    tmp_path: Path, loop: str, workers: int, committed: int, died: int
) -> None:
    """Steps 0..13 (three epochs of 5 batches): the first attempt dies after step `died`
    with step `committed` the last one committed; the resumed attempt must see exactly the
    batches an uninterrupted run sees from there, the later epochs' orders included."""
    total = 14
    reference: list[Seen] = []
    Run(tmp_path / "ref", spec(total=total, every=100)).attempt(LOOPS[loop](workers, reference))
    (whole,) = reference
    assert sorted(i for b in whole[:EPOCH] for i in b) == list(range(20)), (
        "one epoch: each item once"
    )
    assert whole[:EPOCH] != whole[EPOCH : 2 * EPOCH], "epochs must be shuffled anew"

    seen: list[Seen] = []
    run = Run(tmp_path / "run", spec(total=total, every=100))
    run.attempt(LOOPS[loop](workers, seen), until=died, checkpoint_at=committed)
    assert seen[0] == whole[:died], "the first attempt itself differs from the reference"
    resumed = run.attempt(LOOPS[loop](workers, seen))
    assert resumed.ctx.step == total
    assert seen[1] == whole[committed:], f"resumed at {committed}: {seen[1]} != {whole[committed:]}"
    assert not resumed.divergences()


def test_resuming_mid_epoch_reads_only_what_it_trains_on(tmp_path: Path) -> None:
    """The loader is put back by position, not by reading the epoch up to it: after a
    resume at batch 3 of an epoch and two steps, exactly two batches were read."""
    reads: list[Items] = []
    run = Run(tmp_path, spec(total=10, every=100))
    seen: list[Seen] = []
    run.attempt(baton_loop(0, seen, reads), until=9, checkpoint_at=8)
    assert reads[0].reads.value == 9 * 4

    run.attempt(baton_loop(0, seen, reads), until=10)
    assert len(seen[1]) == 2, seen[1]
    assert reads[1].reads.value == 2 * 4, f"{reads[1].reads.value} items read for 2 batches"


def test_batches_report_the_epoch_and_refuse_an_empty_dataset(tmp_path: Path) -> None:
    run = Run(tmp_path, spec(total=12, every=100))
    epochs: list[int] = []

    def setup(ctx: RunContext) -> Callable[[int], None]:
        batches = ctx.data_loader(Items(), batch_size=4)
        ctx.restore(model=torch.nn.Linear(1, 1))

        def body(step: int) -> None:
            next(batches)
            epochs.append(batches.epoch)

        return body

    run.attempt(setup)
    assert epochs == [0] * 5 + [1] * 5 + [2] * 2, epochs

    def empty(ctx: RunContext) -> Callable[[int], None]:
        batches = ctx.data_loader(Items(0), batch_size=4, shuffle=False)
        ctx.restore(model=torch.nn.Linear(1, 1))
        return lambda step: next(batches)

    with pytest.raises(ValueError, match="yields no batch"):
        Run(tmp_path / "empty", spec(total=2)).attempt(empty)


# -- a run of several ranks: each rank its own share of every epoch ---------------------


def shares(n: int, epochs: int, world: int = 2) -> list[list[list[int]]]:
    """Per rank, the items of each of `epochs` epochs, drawn in batches of 2."""
    out = []
    for rank in range(world):
        batches = Batches(Items(n), batch_size=2, seed=3, rank=rank, world_size=world)
        per_epoch = (n // world + 1) // 2
        mine: list[list[int]] = []
        for _ in range(epochs):
            mine.append([i for _ in range(per_epoch) for i in next(batches).tolist()])
        out.append(mine)
    return out


def test_ranks_draw_disjoint_equal_shares_of_every_epoch() -> None:
    """Every epoch is one permutation dealt out among the ranks: disjoint shares that
    together cover it (cut to a multiple of the group's size), reshuffled every epoch."""
    rank0, rank1 = shares(20, epochs=3)
    for e in range(3):
        assert not set(rank0[e]) & set(rank1[e]), (e, rank0[e], rank1[e])
        assert sorted(rank0[e] + rank1[e]) == list(range(20)), e
    assert rank0[0] != rank0[1] and rank0[1] != rank0[2], "epochs must be shuffled anew"
    # 21 items: one is dropped each epoch, so both ranks' epochs end at the same step.
    rank0, rank1 = shares(21, epochs=2)
    for e in range(2):
        assert len(rank0[e]) == len(rank1[e]) == 10
        assert not set(rank0[e]) & set(rank1[e]) and set(rank0[e] + rank1[e]) < set(range(21))


def checkpointed(batches: Batches) -> tuple[Any, dict[str, torch.Tensor]]:
    """The data position as a checkpoint holds it (the slot's tree and tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = slot_for("data", batches).capture(tensors)
    return tree, {k: v.clone() for k, v in tensors.items()}


@pytest.mark.parametrize(
    ("workers", "at"), [(0, 3), (0, 7), (2, 7)], ids=["mid-epoch", "next-epoch", "2-workers"]
)
def test_each_rank_resumes_its_own_share_exactly(workers: int, at: int) -> None:
    """Each rank, put back at batch `at` (5 batches an epoch per rank), draws exactly what
    it would have drawn — also when the position is saved again before any batch is drawn
    (torchdata's sampler reports its loaded position only once it draws)."""
    for rank in range(2):

        def fresh(rank: int = rank) -> Batches:
            return Batches(Items(), batch_size=2, seed=3, rank=rank, world_size=2,
                           num_workers=workers)  # fmt: skip

        reference = fresh()
        whole = [next(reference).tolist() for _ in range(14)]
        first = fresh()
        assert [next(first).tolist() for _ in range(at)] == whole[:at]
        tree, tensors = checkpointed(first)
        second = fresh()
        slot_for("data", second).load(tree, tensors)
        tree, tensors = checkpointed(second)  # saved again before drawing anything
        third = fresh()
        slot_for("data", third).load(tree, tensors)
        assert [next(third).tolist() for _ in range(14 - at)] == whole[at:], (rank, at)
        assert third.epoch == 2
