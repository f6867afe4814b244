"""Loading a committed checkpoint into a run's registered objects and global RNGs.

Every file is checked before any object is touched: its tensors against what meta.json
recorded and against the live object they go into. A mismatch is refused naming the tensor
and leaves the objects as they were, where `load_state_dict` would fail half-way with torch's
message.

In a run of several ranks each rank loads the replicated objects (model, optimizer, …) from
rank 0's files and its own data positions, generators, RNG states and cursor from its own
shard (`rank<k>.` files; rank 0's are the plain ones): a rank downloads only what it loads.

A sharded object (FSDP2) is read in place, by byte range, from every rank's shard file
(`baton.runtime.shards`): its chunks are checked against meta.json and the live object as it
is loaded, after the objects loaded before it; rank 0 verified every file, and that the
chunks tile each tensor, when it chose the checkpoint (`commit.restorable`).
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from baton.runtime.slots import Slot
from shared.checkpoint import commit
from shared.checkpoint import files as checkpoint_files
from shared.checkpoint.files import META, SUFFIX
from shared.checkpoint.store import Store, open_store
from shared.checkpoint.store.base import sha256_file
from shared.checkpoint.tensors import declared, specs_of
from shared.contracts import FileRef, Manifest
from shared.errors import ContractError, IntegrityError


async def chosen(store: Store, key: str, run_id: str) -> Manifest | None:
    """The manifest rank 0 chose to resume from (`key`; "" for none), for another rank:
    checked as any manifest read from the store. Rank 0 verified its files."""
    if not key:
        return None
    try:
        manifest = await commit.load_manifest(store, key)
    except ContractError as exc:
        raise IntegrityError(f"manifest {key}: {exc}") from None
    if manifest.run_id != run_id or commit.key_of(manifest) != key:
        raise IntegrityError(f"manifest {key} is not one of run {run_id!r}")
    return manifest


class Resumed(NamedTuple):
    step: int
    cursor: dict[str, Any]
    read_bytes: int = 0
    """Bytes read of sharded objects' files (`baton.runtime.shards`)."""
    versions: dict[str, Any] = {}
    """What the checkpoint recorded of the software that wrote it (`baton.runtime.compat`)."""


def load(
    store_url: str,
    manifest: Manifest,
    slots: Sequence[Slot],
    *,
    run_id: str,
    spec_hash: str,
    rank: int = 0,
    verify: bool = False,
) -> Resumed:
    """Load rank `rank`'s shard of a checkpoint that was verified (`commit.restorable`: every
    file, by rank 0; other ranks `verify` the hashes of what they download — in an elastic
    run, rank 0's shard), and this process's chunks of its sharded objects, at this group's
    size (`baton.runtime.shards`)."""
    step, own = manifest.step, checkpoint_files.rank_prefix(rank)

    rng_file = f"{own}rng{SUFFIX}"
    whole = [s for s in slots if not s.sharded]
    if was := [s.name for s in whole if s.name in manifest.sharded]:
        raise IntegrityError(
            f"checkpoint {step}: {was[0]!r} was saved sharded (FSDP2) and is registered"
            " whole: shard it as it was before restore()"
        )
    wanted = {META, own + META, rng_file, *(_file_of(s, own) for s in whole)}
    refs = [f for f in manifest.files if f.name in wanted]
    if missing := sorted(wanted - {f.name for f in refs}):
        raise IntegrityError(f"checkpoint {step} lacks {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="baton-restore-") as tmp:
        local = asyncio.run(download(store_url, refs, Path(tmp), check_hashes=verify))
        return _load_files(
            local, slots, step, rank=rank, run_id=run_id, spec_hash=spec_hash,
            sharded=lambda slot, tree: _load_sharded(store_url, manifest, slot, tree),
        )  # fmt: skip


def load_local(
    directory: Path, slots: Sequence[Slot], step: int, *, run_id: str, spec_hash: str
) -> Resumed:
    """Load a local snapshot of a single-rank run (`baton.runtime.local`): the files of a
    checkpoint of `step`, in `directory` on this host, checked as a downloaded checkpoint's
    are before any object is touched."""
    if sharded := [s.name for s in slots if s.sharded]:
        raise IntegrityError(f"a local snapshot cannot hold the sharded {sharded[0]!r}")
    names = {META, f"rng{SUFFIX}", *(f"{s.name}{SUFFIX}" for s in slots)}
    local = {name: directory / name for name in names}
    if missing := sorted(n for n, p in local.items() if not p.is_file()):
        raise IntegrityError(f"local snapshot {step} lacks {', '.join(missing)}")
    return _load_files(local, slots, step, rank=0, run_id=run_id, spec_hash=spec_hash)


def _load_files(
    local: dict[str, Path],
    slots: Sequence[Slot],
    step: int,
    *,
    rank: int,
    run_id: str,
    spec_hash: str,
    sharded: Callable[[Slot, Any], int] | None = None,
) -> Resumed:
    """Check and load the files of a checkpoint of `step` that are on this host (`local`,
    by name); `sharded` loads a sharded object's chunks and says how many bytes it read."""
    own = checkpoint_files.rank_prefix(rank)

    rng_file = f"{own}rng{SUFFIX}"
    whole = [s for s in slots if not s.sharded]
    shared = _meta(local[META], step, run_id, spec_hash)
    mine = shared if not rank else _meta(local[own + META], step, run_id, spec_hash)
    if mine["step"] != shared["step"] or mine.get("rank", 0) != rank:
        raise IntegrityError(f"checkpoint {step}: {own}{META} is not rank {rank}'s of it")
    trees = {slot.name: _tree(slot, mine, shared, step) for slot in slots}
    for slot in whole:
        checkpoint_files.check_tensors(
            local[_file_of(slot, own)],
            _file_of(slot, own),
            recorded=declared(trees[slot.name]),
            live=slot.live(),
            live_name=f"the {slot.name} being restored",
        )
    checkpoint_files.check_tensors(
        local[rng_file],
        rng_file,
        live=specs_of(rng_state()[0]),
        live_name="this process's RNG",
        required=("torch", "numpy"),
    )
    # Objects, then data loaders, then generators (`baton.runtime.slots`); the global
    # RNGs last.
    read = 0
    for slot in sorted(slots, key=lambda s: s.phase):
        if slot.sharded:
            assert sharded is not None
            read += sharded(slot, trees[slot.name])
        else:
            name = _file_of(slot, own)
            _load_whole(slot, trees[slot.name], local[name], name, step)
    rng = checkpoint_files.load_tensors(local[rng_file], rng_file)
    try:
        set_rng_state(rng, mine["rng"])
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"checkpoint {step}: malformed RNG state: {exc!r}") from None
    versions = shared.get("versions")
    recorded = versions if isinstance(versions, dict) else {}
    return Resumed(mine["step"], mine["cursor"], read, recorded)


def _file_of(slot: Slot, own: str) -> str:
    """The file holding a whole slot's tensors, for the rank whose prefix is `own`."""
    return f"{own if slot.per_rank else ''}{slot.name}{SUFFIX}"


def _load_whole(slot: Slot, tree: Any, path: Path, name: str, step: int) -> None:
    tensors = checkpoint_files.load_tensors(path, name)
    try:
        slot.load(tree, tensors)
    except RecursionError:
        raise IntegrityError(f"checkpoint {step}: {name!r} nested too deeply") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"checkpoint {step}: cannot restore {name!r}: {exc}") from exc


def _tree(slot: Slot, mine: dict[str, Any], shared: dict[str, Any], step: int) -> Any:
    """A slot's JSON tree: from this rank's meta.json if the slot is its own, else rank 0's
    (a sharded object's included: its chunks are checked as they are loaded)."""
    state = (mine if slot.per_rank else shared)["state"]
    if slot.name not in state:
        raise IntegrityError(f"checkpoint {step} has no state for {slot.name!r}")
    return state[slot.name]


def _load_sharded(store_url: str, manifest: Manifest, slot: Slot, tree: Any) -> int:
    """Load this process's chunks of a sharded object; the bytes read."""
    from baton.runtime.shards import load_sharded

    if slot.name not in manifest.sharded:
        raise IntegrityError(
            f"checkpoint {manifest.step}: {slot.name!r} was not saved sharded and is sharded"
            " now: load it whole, then shard it"
        )
    files = [f for f in manifest.files if checkpoint_files.group_of(f.name) == slot.name]
    state, reader = load_sharded(store_url, files, slot.name, tree, slot.target())
    by_key: dict[str, list[str]] = {}
    for key, begin, end in reader.ranges:
        by_key.setdefault(key, []).append(f"{begin}-{end}")
    for key, ranges in by_key.items():  # the store's request log, as this rank made it
        print(f"baton: {slot.name}: read {key} bytes {' '.join(ranges)}", file=sys.stderr)
    try:
        slot.put(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise IntegrityError(
            f"checkpoint {manifest.step}: cannot restore {slot.name!r}: {exc}"
        ) from exc
    return reader.read_bytes


def _meta(path: Path, step: int, run_id: str, spec_hash: str) -> dict[str, Any]:
    meta = checkpoint_files.read_meta(path)
    if meta.get("run_id") != run_id or meta.get("spec_hash") != spec_hash:
        raise IntegrityError(f"checkpoint {step} belongs to another run or job spec")
    state, cursor, saved = meta.get("state"), meta.get("cursor"), meta.get("step")
    if not (isinstance(state, dict) and isinstance(cursor, dict) and type(saved) is int):
        raise IntegrityError(f"checkpoint {step}: {path.name} lacks state, cursor or step")
    return meta


async def download(
    store_url: str, files: list[FileRef], into: Path, *, check_hashes: bool = False
) -> dict[str, Path]:
    out = {}
    async with open_store(store_url) as store:
        for ref in files:
            # A name becomes a local path here: refuse one that would land outside `into`,
            # whatever checks the manifest passed before.
            path = into / checkpoint_files.check_name(ref.name)
            if path.parent != into or ref.name in out:
                raise IntegrityError(f"checkpoint file {ref.name!r} cannot be downloaded")
            out[ref.name] = path
            await store.download(ref.key, path)
            if check_hashes and await asyncio.to_thread(sha256_file, path) != (
                ref.size,
                ref.sha256,
            ):
                raise IntegrityError(f"{ref.name}: its bytes differ from the manifest's")
    return out


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's global RNG states: torch's (CUDA's too), numpy's and Python's."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss_next = random.getstate()
    return tensors, {
        "numpy": [kind, int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss_next],
    }


def set_rng_state(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = js["python"]
    random.setstate((version, tuple(internal), gauss_next))
