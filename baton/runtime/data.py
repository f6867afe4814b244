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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader


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
        **loader_options: Any,
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn,
            generator=self.generator,
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
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
        raise ValueError("the data loader yields no batch: is the dataset empty?")

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, **loader_state(self.loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch = state.get("epoch")
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"a data position needs a whole epoch number, not {epoch!r}")
        load_loader_state(self.loader, state)
        self.epoch = epoch
        self._it = None
