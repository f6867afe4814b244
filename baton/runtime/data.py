"""Resumable data positions, built on torchdata's `StatefulDataLoader`.

`StatefulDataLoader` already knows where an epoch is: its `state_dict()` holds the sampler's
permutation seed and how many samples were handed out (and, with workers, each worker's
state), and a loaded state fast-forwards the *index* sampler — no sample before the offset
is read again (`bench/data_resume.py` counts the reads). What it does not hold is the live
state of the `torch.Generator` it was given: that generator draws every epoch's permutation
(and the workers' base seed), so a resumed run with a fresh generator shuffles every later
epoch differently.

Capturing the generator is not enough either, because of when it must be put back.
Creating the resumed iterator draws from the generator again (the new iterator's seeds, a
permutation that the loaded sampler state then replaces), so a state set before that draw
is overwritten by it. `load_loader_state` therefore creates the resumed iterator itself —
through the loader's own `state_dict()`, which builds an iterator from a loaded state and
hands that same iterator to the next `iter(loader)` — and sets the generators after it.

`Batches` is the common case made short: an endless stream of batches over a map-style
dataset, reshuffled every epoch from the run's seed, that a training loop draws from once per
step. It is registered with the run by `RunContext.data_loader`.

In a run of several ranks, `Batches` gives each rank its own share of every epoch, through
torchdata's `StatefulDistributedSampler` (checked against torchdata 0.11): every rank draws
the same permutation (from seed + epoch, not from a generator's live state, so nothing but
the epoch needs to be the same on every rank), cut to a multiple of the group's size and
dealt out as `indices[rank::world_size]` — disjoint shares of equal length, so every rank's
epochs end at the same step. Its state is how many of its indices the rank has drawn, and a
resume skips that many *indices*, reading no sample (like the single-rank case). Two things
it leaves to its user are done here: it reshuffles only when told the epoch (`set_epoch`,
before each epoch and before a resumed one), and its `state_dict()` reports the old count
until the first index after a load is drawn (`_Shard`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


def generators_of(loader: StatefulDataLoader) -> list[torch.Generator]:
    """Every distinct generator the loader draws from: its own, and its samplers' (torchdata's
    shuffling sampler makes one of its own when the loader was given none)."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for holder in (loader, loader.sampler, getattr(batch_sampler, "sampler", None)):
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def loader_state(loader: StatefulDataLoader) -> dict[str, Any]:
    """The loader's position and its generators' live states, as of now."""
    return {
        "loader": loader.state_dict(),
        "generators": [g.get_state() for g in generators_of(loader)],
    }


def load_loader_state(loader: StatefulDataLoader, state: dict[str, Any]) -> None:
    """Put the loader back where `loader_state` found it; the next `iter(loader)` continues
    with exactly the batch an uninterrupted run would have seen next."""
    gens = generators_of(loader)
    saved = state.get("generators")
    if not isinstance(saved, list) or len(saved) != len(gens):
        raise ValueError(
            f"the checkpoint holds {len(saved) if isinstance(saved, list) else 'no'} generator"
            f" states for a data loader that draws from {len(gens)}"
        )
    loader.load_state_dict(state["loader"])
    loader.state_dict()  # builds the resumed iterator now: it draws from the generators
    for g, s in zip(gens, saved, strict=True):
        g.set_state(s)


class _Shard(StatefulDistributedSampler):  # type: ignore[misc]
    """A rank's share of each epoch. torchdata's sampler takes a loaded position only when
    its next iterator starts drawing; until then its `state_dict()` would report the count
    from before the load, and a checkpoint taken then would resume at the wrong sample."""

    def state_dict(self) -> dict[str, Any]:
        if self.next_yielded is not None:
            return {self._YIELDED: self.next_yielded}
        return super().state_dict()  # type: ignore[no-any-return]


class Batches:
    """An endless, resumable stream of batches: epoch after epoch over a map-style dataset,
    each epoch in a new order drawn from a generator seeded by the run. Draw one batch per
    step (`next(batches)` inside `for step in ctx.steps()`), so that a checkpoint taken
    between steps holds exactly the batches consumed so far."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        **loader_options: Any,
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        """Draws each epoch's order in a single-rank run; the workers' seeds in any run."""
        self._shard: _Shard | None = None
        order: dict[str, Any] = {"shuffle": shuffle}
        if world_size > 1:
            if "sampler" in loader_options or "batch_sampler" in loader_options:
                raise ValueError("ctx.data_loader() shares the data out among ranks itself:"
                                 " pass it no sampler")  # fmt: skip
            self._shard = _Shard(
                dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                drop_last=True,
            )  # fmt: skip
            order = {"sampler": self._shard}
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn,
            generator=self.generator,
            **order,
            **loader_options,
        )
        self.epoch = 0
        """Epochs completed so far: the epoch the next batch comes from."""
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # one epoch ending, then the next one's first batch
            if self._it is None:
                if self._shard is not None:
                    self._shard.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
        raise ValueError("the data loader yields no batch: is the dataset empty?")

    def skip(self, batches: int) -> None:
        """Leave out the next `batches` batches (a rolled-back run's, `shared.contracts.Skip`):
        they are drawn and dropped, so the position after them is exactly that of a run that
        trained on them, whatever the workers and the epochs."""
        for _ in range(batches):
            next(self)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, **loader_state(self.loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch = state.get("epoch")
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"a data position needs a whole epoch number, not {epoch!r}")
        if self._shard is not None:
            self._shard.set_epoch(epoch)  # the resumed iterator draws that epoch's order
        load_loader_state(self.loader, state)
        self.epoch = epoch
        self._it = None
