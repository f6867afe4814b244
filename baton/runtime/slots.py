"""What `RunContext.restore()` accepts, and how each kind is captured and put back.

A checkpoint holds, per registered name, one safetensors file of tensors and one JSON tree
(`shared.checkpoint.tensors`). Four kinds of object can be registered:

* anything with `state_dict()`/`load_state_dict()`: a model, an optimizer, a scheduler, a
  `GradScaler`, a `baton.Batches`;
* torchdata's `StatefulDataLoader`, with the live state of the generators it draws from,
  which its own `state_dict()` leaves out (`baton.runtime.data`);
* a `torch.Generator` (CPU or CUDA): its state is a byte tensor;
* a dict or list of JSON values, put back in place (the caller keeps its reference).

Anything else is refused by name and type when it is registered, not when the first
checkpoint is due. The order of loading matters: objects first, then data loaders (creating
their resumed iterators draws from generators), then generators, and the global RNGs last
(`RunContext`), so every random state ends as it was saved, whatever drew from it on the way.

In a run of several ranks, what a slot holds is either the same on every rank or the rank's
own (`per_rank`). Models, optimizers, schedulers and JSON values are replicated (the user's
DDP keeps them so), and rank 0's copy is the one saved. Data loaders and generators are per
rank: each rank reads its own shard of the data and draws its own numbers, so each rank
saves and restores its own.

Capture copies: the tree `flatten` returns is built anew and its leaves are immutable, and
the tensors are copied into the snapshot's buffers before the loop goes on, so nothing a
checkpoint holds can change after the step it names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from baton.runtime.data import Batches, load_loader_state, loader_state
from shared.checkpoint.files import TensorSpec
from shared.checkpoint.tensors import Tree, flatten, specs_of, unflatten


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


class Slot(ABC):
    """One registered name: how its object becomes (tensors, tree) and back."""

    phase = 0
    """Load order: 0 objects, 1 data loaders, 2 generators."""
    per_rank = False
    """Whether each rank of a group saves its own (data positions, generators), or rank 0
    saves the one all ranks share (the model, the optimizer)."""

    def __init__(self, name: str, obj: Any) -> None:
        self.name = name
        self.obj = obj

    def capture(self, tensors: dict[str, torch.Tensor]) -> Tree:
        """The object's state now: tensors into `tensors` (under this name), the rest as
        the returned tree."""
        return flatten(self.state(), self.name, tensors)

    def live(self) -> dict[str, TensorSpec] | None:
        """The tensors the object holds now, to check a checkpoint against before loading
        anything; None where asking would have side effects."""
        tensors: dict[str, torch.Tensor] = {}
        flatten(self.state(), self.name, tensors)
        return specs_of(tensors)

    def load(self, tree: Tree, tensors: dict[str, torch.Tensor]) -> None:
        self.put(unflatten(tree, tensors))

    @abstractmethod
    def state(self) -> Any: ...

    @abstractmethod
    def put(self, state: Any) -> None: ...


class ObjectSlot(Slot):
    def state(self) -> Any:
        return self.obj.state_dict()

    def put(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class BatchesSlot(ObjectSlot):
    phase = 1
    per_rank = True

    def live(self) -> dict[str, TensorSpec] | None:
        return None  # its state_dict() would start the loader's workers


class LoaderSlot(Slot):
    phase = 1
    per_rank = True

    def state(self) -> Any:
        return loader_state(self.obj)

    def live(self) -> dict[str, TensorSpec] | None:
        return None  # its state_dict() would start the loader's workers

    def put(self, state: Any) -> None:
        load_loader_state(self.obj, state)


class GeneratorSlot(Slot):
    phase = 2
    per_rank = True

    def state(self) -> Any:
        return {"state": self.obj.get_state()}

    def put(self, state: Any) -> None:
        self.obj.set_state(state["state"])


class JsonSlot(Slot):
    def state(self) -> Any:
        return self.obj  # `flatten` copies it, and refuses what JSON cannot hold, by path

    def put(self, state: Any) -> None:
        if isinstance(self.obj, dict) and isinstance(state, dict):
            self.obj.clear()
            self.obj.update(state)
        elif isinstance(self.obj, list) and isinstance(state, list):
            self.obj[:] = state
        else:
            raise ValueError(
                f"{self.name!r} was saved as {type(state).__name__},"
                f" registered now as {type(self.obj).__name__}"
            )


def slot_for(name: str, obj: Any) -> Slot:
    """The slot for a registered object, or a `TypeError` naming it and what is accepted."""
    if isinstance(obj, Batches):
        return BatchesSlot(name, obj)
    if isinstance(obj, StatefulDataLoader):
        return LoaderSlot(name, obj)
    if isinstance(obj, torch.Generator):
        return GeneratorSlot(name, obj)
    if isinstance(obj, Stateful):
        return ObjectSlot(name, obj)
    if isinstance(obj, dict | list):
        slot = JsonSlot(name, obj)
        slot.capture({})  # refuse what cannot be saved now, not at the first checkpoint
        return slot
    hint = ""
    if isinstance(obj, DataLoader):
        hint = (
            " A torch DataLoader keeps no position: use ctx.data_loader(...), or torchdata's"
            " StatefulDataLoader."
        )
    elif hasattr(obj, "__next__"):
        hint = " An iterator's position cannot be saved: register what it iterates over."
    elif isinstance(obj, bool | int | float | str) or obj is None:
        hint = " A plain value cannot be put back in place: keep it in a dict and register that."
    raise TypeError(
        f"restore({name}=…) cannot checkpoint a {type(obj).__module__}.{type(obj).__qualname__}:"
        " register objects with state_dict()/load_state_dict() (model, optimizer, scheduler,"
        " GradScaler, StatefulDataLoader), torch.Generator objects, or dicts/lists of JSON"
        f" values.{hint}"
    )
