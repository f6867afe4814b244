"""Sharded objects (FSDP2: DTensors) in a checkpoint, from the training process's side.

Saving: every rank copies out only its own chunk of each tensor (`local`) and writes it
with its offsets in the whole (`shared.checkpoint.shards`); a tensor every rank holds whole
(a plain tensor, an optimizer's step) is written by rank 0 alone. Nothing is gathered: no
rank ever holds more than its own chunks.

Loading, at the group's size now, whatever it was when saved: the object's own state dict
at the current size is the target (`Slot.state()`: DTensors of this group's mesh, an
optimizer's state set up by torch), and torch.distributed.checkpoint (DCP) plans what to
read, from the chunks every rank wrote, to fill this rank's chunks. `StoreReader` is DCP's
`StorageReader` over the object store: it reads each shard file's header, then only the
byte ranges of the chunks the plan needs — for FSDP2's row shards, exactly the rows this
rank owns now, each one ranged GET (`Store.get_range`). DCP runs here without collectives
(`no_dist`): each rank's plan needs nothing from the others, and a load needs no group.

What the checks guarantee before anything is loaded: the chunks tile every tensor exactly,
the whole tensors are what rank 0's meta.json recorded, and the live object has the same
tensors with the same dtypes and shapes. DCP's `HuggingFaceStorageReader` reads the same
files from a local directory (`baton pull --shards`).
"""

from __future__ import annotations

import asyncio
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shared.checkpoint import shards
from shared.checkpoint.files import TensorSpec, compare, header_length, parse_header
from shared.checkpoint.store import Store, open_store
from shared.checkpoint.tensors import DTYPES, Tree, declared, flatten, specs_of, unflatten
from shared.contracts import FileRef
from shared.errors import IntegrityError

CONCURRENCY = 8
"""Ranged reads in flight per rank."""


def local(
    tensors: dict[str, torch.Tensor], rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This rank's chunks of a sharded object's tensors (views, not copies) and its shard
    file's `__metadata__`: each DTensor's local chunk where this rank is the one to write it,
    each plain tensor on rank 0 alone."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    chunks: dict[str, torch.Tensor] = {}
    offsets: dict[str, tuple[int, ...]] = {}
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            if rank == 0:
                chunks[name], offsets[name] = t, (0,) * t.dim()
            continue
        if any(isinstance(p, Partial) for p in t.placements):
            raise TypeError(f"{name}: a DTensor with a pending reduction cannot be checkpointed")
        coordinate = list(t.device_mesh.get_coordinate() or ())
        if any(
            isinstance(p, Replicate) and c for p, c in zip(t.placements, coordinate, strict=False)
        ):
            continue  # a replica of a chunk another rank writes (HSDP's replicated dimension)
        piece = t.to_local()
        if piece.numel() == 0 and (t.numel() or rank):
            continue  # more ranks than rows: this rank holds nothing of it (an empty
            # tensor's place is kept by rank 0's empty chunk)
        chunks[name], offsets[name] = piece, _offsets(t)
    return chunks, shards.sharding_info(offsets)


_WHERE: dict[tuple[Any, ...], tuple[int, ...]] = {}
"""Where this rank's chunk of a DTensor sits, by its shape, placements and mesh: the same
at every checkpoint, and two thirds of what taking a checkpoint's chunks costs to ask."""


def _offsets(t: Any) -> tuple[int, ...]:
    key = (tuple(t.shape), tuple(t.placements), t.device_mesh)
    if key not in _WHERE:
        # DCP's own question to a DTensor: where its local chunk sits in the whole.
        (chunk,) = t.__create_chunk_list__()
        _WHERE[key] = tuple(chunk.offsets)
    return _WHERE[key]


class StoreReader(StorageReader):
    """DCP's reader for one sharded object's files in the store: every rank's shard file of
    it (`files`), read by header and then by the byte ranges a load plan needs."""

    def __init__(self, store_url: str, files: Sequence[FileRef], label: str) -> None:
        super().__init__()
        self._url = store_url
        self._files = list(files)
        self._label = label
        self._where: dict[MetadataIndex, tuple[str, shards.Chunk]] = {}
        self.whole: dict[str, TensorSpec] = {}
        """The tensors the chunks make up, once `read_metadata` checked them."""
        self._metadata: Metadata | None = None
        self.read_bytes = 0
        self.ranges: list[tuple[str, int, int]] = []
        """Every ranged read made, headers included: (key, begin, end)."""

    # -- StorageReader -------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        found = asyncio.run(self._headers())
        self.whole = shards.tile([c for _, chunks in found for c in chunks], self._label)
        state: dict[str, TensorStorageMetadata] = {}
        for name, spec in self.whole.items():
            state[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[spec.dtype]),
                size=torch.Size(spec.shape),
                chunks=[],
            )
        for key, chunks in found:
            for c in chunks:
                state[c.name].chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(c.offsets), sizes=torch.Size(c.spec.shape)
                    )
                )
                self._where[MetadataIndex(c.name, c.offsets)] = (key, c)
        self._metadata = Metadata(state_dict_metadata=dict(state))
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        asyncio.run(self._read(plan.items, planner))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    # -- the store -----------------------------------------------------------------------

    async def _headers(self) -> list[tuple[str, list[shards.Chunk]]]:
        async with open_store(self._url) as store:
            out = []
            for ref in self._files:
                first = await self._range(store, ref.key, 0, min(ref.size, 8))
                length = header_length(first, ref.size, ref.name)
                raw = await self._range(store, ref.key, 8, 8 + length) if length else b""
                header = parse_header(raw, ref.size, ref.name)
                out.append((ref.key, shards.chunks_of(header, ref.name)))
            return out

    async def _read(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with open_store(self._url) as store:

            async def one(item: ReadItem) -> None:
                key, chunk = self._where[item.storage_index]
                begin, end, shape, narrow = _span(chunk, item)
                if begin == end:
                    return
                async with gate:
                    data = await self._range(store, key, begin, end)
                with warnings.catch_warnings():  # read only: copied into the target below
                    warnings.simplefilter("ignore", UserWarning)  # "not writable"
                    got = torch.frombuffer(data, dtype=DTYPES[chunk.spec.dtype]).reshape(shape)
                for dim, (at, n) in enumerate(narrow):
                    got = got.narrow(dim, at, n)
                target = planner.resolve_tensor(item).detach()
                if target.shape != got.shape:
                    raise IntegrityError(
                        f"{self._label}: {chunk.name} read as {list(got.shape)}, needed"
                        f" {list(target.shape)}"
                    )
                target.copy_(got)
                planner.commit_tensor(item, target)

            await asyncio.gather(*(one(i) for i in items))

    async def _range(self, store: Store, key: str, begin: int, end: int) -> bytes:
        data = await store.get_range(key, begin, end)
        self.read_bytes += len(data)
        self.ranges.append((key, begin, end))
        return data


def _span(
    chunk: shards.Chunk, item: ReadItem
) -> tuple[int, int, tuple[int, ...], list[tuple[int, int]]]:
    """The bytes of `chunk` that `item` needs: its rows, when it wants whole rows (FSDP2's
    row shards always do), else the whole chunk; the shape read and what to narrow it by."""
    shape = chunk.spec.shape
    at, n = list(item.storage_offsets), list(item.lengths)
    begin, end = chunk.span
    if not shape:
        return begin, end, (), []
    if all(a == 0 and k == s for a, k, s in zip(at[1:], n[1:], shape[1:], strict=True)):
        row = (end - begin) // shape[0] if shape[0] else 0
        return begin + at[0] * row, begin + (at[0] + n[0]) * row, (n[0], *shape[1:]), []
    if math.prod(n) == 0:
        return begin, begin, tuple(n), []
    return begin, end, shape, list(zip(at, n, strict=True))


def load_sharded(
    store_url: str, files: Sequence[FileRef], name: str, tree: Tree, live: Any
) -> tuple[Any, StoreReader]:
    """The state to put back into a sharded object: `live`, its state dict at this group's
    size, filled with the checkpoint's values (`tree` from rank 0's meta.json, the chunks
    from every rank's `files`). Returns it and the reader, which says what it read."""
    targets: dict[str, torch.Tensor] = {}
    flatten(live, name, targets)
    label = f"{name} (sharded)"
    reader = StoreReader(store_url, files, label)
    reader.read_metadata()
    saved = declared(tree)
    compare(label, reader.whole, saved, "meta.json", exact=True)
    if not saved:  # an optimizer saved before its first step: it holds no state yet
        return unflatten(tree, {}), reader
    compare(label, reader.whole, specs_of(targets), f"the {name} being restored", exact=True)
    dcp_load(targets, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    return unflatten(tree, targets), reader
