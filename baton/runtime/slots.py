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
checkpoint is due. A model sharded with FSDP2's `fully_shard` (DTensor parameters) and the
optimizer that steps it are recognised as sharded (`baton.runtime.shards`). The order of
loading matters: objects first, then data loaders (creating their resumed iterators draws
from generators), then generators, and the global RNGs last (`RunContext`), so every random
state ends as it was saved, whatever drew from it on the way.

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

import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
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
    sharded = False
    """Whether each rank holds a part of it (an FSDP2 model and its optimizer): every rank
    saves its own chunks, and a load reads the chunks the rank owns now
    (`baton.runtime.shards`)."""

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

    def target(self) -> Any:
        """The state a sharded checkpoint is loaded into, in place (`baton.runtime.shards`)."""
        return self.state()

    @abstractmethod
    def state(self) -> Any: ...

    @abstractmethod
    def put(self, state: Any) -> None: ...


class ObjectSlot(Slot):
    def state(self) -> Any:
        return self.obj.state_dict()

    def put(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class ShardedModelSlot(ObjectSlot):
    """A module whose parameters are DTensors (`fully_shard`): its state dict as
    torch.distributed.checkpoint.state_dict gives it, each rank's part of every tensor."""

    sharded = True

    def state(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.obj)

    def put(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.obj, state)


class ShardedOptimizerSlot(ObjectSlot):
    """An optimizer of a sharded module's parameters, keyed by parameter name (not index),
    as DCP keys it.

    torch describes an optimizer that has not stepped yet by setting its state up first
    (one step with zero gradients at learning rate zero: AdamW's count is then 1). That is
    the target a checkpoint is loaded into (`target`), but a checkpoint of an optimizer that
    has not stepped must not change it: `state` then undoes the set-up and saves no state,
    so the next step is the optimizer's first, as in a run that took no checkpoint."""

    sharded = True

    def __init__(self, name: str, obj: Any, model: torch.nn.Module) -> None:
        super().__init__(name, obj)
        self.model = model

    def state(self) -> Any:
        fresh = not self.obj.state
        state = self.target()
        if fresh:
            self.obj.state.clear()
            state = {**state, "state": {}}
        return state

    def target(self) -> Any:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.obj)

    def put(self, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.obj, state)


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


def slots_for(registered: dict[str, Any]) -> list[Slot]:
    """The slots of everything registered at once: an optimizer of sharded parameters is
    checkpointed through the module it steps, which must be registered with it."""
    slots = [slot_for(name, obj) for name, obj in registered.items()]
    models = [s for s in slots if isinstance(s, ShardedModelSlot)]
    for i, slot in enumerate(slots):
        if not (isinstance(slot.obj, torch.optim.Optimizer) and _sharded_params(slot.obj)):
            continue
        params = {id(p) for g in slot.obj.param_groups for p in g["params"]}
        owner = [m for m in models if params <= {id(p) for p in m.obj.parameters()}]
        if not owner:
            raise TypeError(
                f"restore({slot.name}=…) steps sharded parameters (FSDP2) of no registered"
                " module: register the sharded model in the same restore() call"
            )
        slots[i] = ShardedOptimizerSlot(slot.name, slot.obj, owner[0].obj)
    return slots


def _sharded_params(obj: Any) -> bool:
    if isinstance(obj, torch.nn.Module):
        return is_sharded(list(obj.parameters()))
    return is_sharded([p for g in obj.param_groups for p in g["params"]])


def slot_for(name: str, obj: Any) -> Slot:
    """The slot for a registered object, or a `TypeError` naming it and what is accepted."""
    if isinstance(obj, Batches):
        return BatchesSlot(name, obj)
    if isinstance(obj, StatefulDataLoader):
        return LoaderSlot(name, obj)
    if isinstance(obj, torch.Generator):
        return GeneratorSlot(name, obj)
    if isinstance(obj, torch.nn.Module) and _sharded_params(obj):
        return ShardedModelSlot(name, obj)
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


def is_sharded(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of `tensors` is a DTensor. torch's DTensor is looked for only if something
    imported it (FSDP2 has, by the time a model is registered): a run that shards nothing
    never pays for importing torch.distributed."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return isinstance(dtensor, type) and any(isinstance(t, dtensor) for t in tensors)
