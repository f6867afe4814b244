"""Sharded state in a checkpoint: each rank's chunks of the tensors it owns, and the check
that together they are every tensor, whole.

A registered object whose tensors are sharded across a group (an FSDP2 model and its
optimizer: DTensors) is checkpointed as one safetensors file per rank, `<group>.safetensors`
under the rank's prefix, holding that rank's chunk of each tensor under the tensor's name.
Where each chunk sits in the whole tensor is in the file's `__metadata__`, under the key and
in the layout torch.distributed.checkpoint (DCP) itself writes and reads for safetensors:

    "DCP_SHARDING_INFO": '{"model.0.weight": {"saved_offsets": [25, 0]}, ...}'

so a rank's shard file is a plain DCP shard: a directory of them loads with plain DCP's
`HuggingFaceStorageReader` (docs/sharded.md). A tensor the ranks share whole (a plain tensor:
an optimizer's step count) is saved once, by rank 0, at offsets 0.

Nothing about a chunk is trusted before it is checked here: its offsets (one per dimension,
non-negative, inside the whole), and that the chunks of every tensor tile it exactly — no
overlap, no gap, one dtype. The whole tensor's shape is not written anywhere but in the
chunks, so it is taken as the box they span; a missing last rank would shrink that box, and
is refused earlier, because every rank's shard file must be listed (`files.check_shards`).
This module never imports torch: the checkpointer checks shards without loading a tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from shared.checkpoint.files import Header, TensorSpec
from shared.errors import IntegrityError

SHARDING_KEY = "DCP_SHARDING_INFO"
"""DCP's `__metadata__` key for chunk offsets (torch.distributed.checkpoint._hf_utils)."""
OFFSETS = "saved_offsets"


class Chunk(NamedTuple):
    """One rank's piece of one tensor, as its shard file says."""

    name: str
    offsets: tuple[int, ...]
    spec: TensorSpec
    """The chunk's own dtype and shape."""
    span: tuple[int, int]
    """Its bytes in the file: [begin, end) from the file's first byte."""

    @property
    def numel(self) -> int:
        return math.prod(self.spec.shape)


def sharding_info(offsets: Mapping[str, Iterable[int]]) -> dict[str, str]:
    """The `__metadata__` of a shard file whose tensors sit at `offsets` in the whole."""
    info = {name: {OFFSETS: list(map(int, at))} for name, at in offsets.items()}
    return {SHARDING_KEY: json.dumps(info, sort_keys=True, separators=(",", ":"))}


def chunks_of(header: Header, label: str) -> list[Chunk]:
    """The chunks a shard file's checked header holds, each with its offsets."""
    raw = header.metadata.get(SHARDING_KEY)
    if raw is None:
        raise IntegrityError(f"{label}: a shard file without {SHARDING_KEY} in its metadata")
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{label}: {SHARDING_KEY} is not JSON: {exc}") from None
    if not isinstance(info, dict) or set(info) != set(header.tensors):
        raise IntegrityError(f"{label}: {SHARDING_KEY} does not name exactly the file's tensors")
    out = []
    for name, spec in sorted(header.tensors.items()):
        entry = info[name]
        at = entry.get(OFFSETS) if isinstance(entry, dict) else None
        if not (
            isinstance(at, list)
            and len(at) == len(spec.shape)
            and all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 2**62 for o in at)
        ):
            raise IntegrityError(
                f"{label}: tensor {name!r} has offsets {at!r}, not {len(spec.shape)} sizes"
            )
        out.append(Chunk(name, tuple(at), spec, header.spans[name]))
    return out


def tile(chunks: Iterable[Chunk], label: str) -> dict[str, TensorSpec]:
    """The whole tensors that `chunks` (every rank's) make up, once they are checked to tile
    each one exactly: one dtype and number of dimensions, no two overlapping, no gap."""
    by_name: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_name.setdefault(chunk.name, []).append(chunk)
    whole: dict[str, TensorSpec] = {}
    for name, pieces in sorted(by_name.items()):
        first = pieces[0].spec
        for p in pieces:
            if p.spec.dtype != first.dtype or len(p.spec.shape) != len(first.shape):
                raise IntegrityError(
                    f"{label}: tensor {name!r} has chunks of {first} and of {p.spec}"
                )
        shape = tuple(
            max(p.offsets[d] + p.spec.shape[d] for p in pieces) for d in range(len(first.shape))
        )
        for i, a in enumerate(pieces):
            for b in pieces[i + 1 :]:
                if a.numel and b.numel and _overlap(a, b):
                    raise IntegrityError(
                        f"{label}: tensor {name!r} has overlapping chunks at {list(a.offsets)}"
                        f" and {list(b.offsets)}"
                    )
        if sum(p.numel for p in pieces) != math.prod(shape):
            raise IntegrityError(
                f"{label}: the chunks of tensor {name!r} do not cover its {list(shape)}"
            )
        whole[name] = TensorSpec(first.dtype, shape)
    return whole


def _overlap(a: Chunk, b: Chunk) -> bool:
    return all(
        a.offsets[d] < b.offsets[d] + b.spec.shape[d]
        and b.offsets[d] < a.offsets[d] + a.spec.shape[d]
        for d in range(len(a.offsets))
    )
