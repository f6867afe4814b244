"""Sharded checkpoints at the commit: every rank's chunks must be listed and must tile each
tensor exactly, under a token that is not stale; a refused commit writes nothing, and the
run resumes from the checkpoint before it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from shared.checkpoint import commit
from shared.checkpoint.files import Header, TensorSpec
from shared.checkpoint.shards import Chunk, chunks_of, sharding_info, tile
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, FileRef
from shared.errors import IntegrityError, NotFound, StaleToken

WHOLE = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def chunk(name: str, offsets: tuple[int, ...], shape: tuple[int, ...], dtype: str = "F32") -> Chunk:
    return Chunk(name, offsets, TensorSpec(dtype, shape), (0, 0))


def test_chunks_that_tile_a_tensor_make_it_whole() -> None:
    found = tile([chunk("w", (0, 0), (3, 4)), chunk("w", (3, 0), (3, 4)), chunk("s", (), ())], "m")
    assert found == {"w": TensorSpec("F32", (6, 4)), "s": TensorSpec("F32", ())}


@pytest.mark.parametrize(
    ("chunks", "needle"),
    [
        ([chunk("w", (0, 0), (3, 4)), chunk("w", (2, 0), (4, 4))], "overlapping"),
        ([chunk("w", (0, 0), (2, 4)), chunk("w", (3, 0), (3, 4))], "do not cover"),
        ([chunk("w", (0, 0), (3, 4)), chunk("w", (3, 0), (3, 4), "F16")], "chunks of"),
        ([chunk("w", (0, 0), (3, 4)), chunk("w", (3,), (3,))], "chunks of"),
    ],
    ids=["overlap", "gap", "two-dtypes", "two-ranks-of-dims"],
)
def test_chunks_that_do_not_tile_are_refused(chunks: list[Chunk], needle: str) -> None:
    with pytest.raises(IntegrityError, match=needle):
        tile(chunks, "m")


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        ({}, "without DCP_SHARDING_INFO"),
        ({"DCP_SHARDING_INFO": "{"}, "not JSON"),
        ({"DCP_SHARDING_INFO": '{"other": {"saved_offsets": [0]}}'}, "exactly the file's"),
        ({"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [0]}}'}, "not 2 sizes"),
        ({"DCP_SHARDING_INFO": '{"w": {"saved_offsets": [0, -1]}}'}, "not 2 sizes"),
        ({"DCP_SHARDING_INFO": '{"w": [0, 0]}'}, "not 2 sizes"),
    ],
)
def test_a_shard_files_offsets_are_checked(metadata: dict[str, str], needle: str) -> None:
    header = Header({"w": TensorSpec("F32", (3, 4))}, {"w": (100, 148)}, metadata)
    with pytest.raises(IntegrityError, match=needle):
        chunks_of(header, "model.safetensors")


async def put(store: FileStore, token: int, step: int, name: str, data: bytes) -> FileRef:
    key = commit.data_key("r", token, step, name)
    await store.put_once(key, data)
    return FileRef(name=name, key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


async def checkpoint(
    store: FileStore, token: int, step: int, rows: list[tuple[int, int]]
) -> list[FileRef]:
    """Two ranks' files of a run whose `model` is sharded: rank k holds `rows[k]` of WHOLE."""
    refs = []
    for rank, (begin, end) in enumerate(rows):
        prefix = f"rank{rank}." if rank else ""
        piece = {"model.w": WHOLE[begin:end].clone()}
        shard = save(piece, metadata=sharding_info({"model.w": (begin, 0)}))
        refs.append(await put(store, token, step, f"{prefix}model.safetensors", shard))
        refs.append(await put(store, token, step, f"{prefix}rng.safetensors", save({"t": WHOLE})))
        refs.append(await put(store, token, step, f"{prefix}meta.json", b"{}"))
    return refs


def request(token: int, step: int, refs: list[FileRef]) -> CommitRequest:
    return CommitRequest(
        run_id="r", token=token, step=step, worker="w", files=refs, ranks=2, sharded=["model"]
    )


async def test_a_sharded_commit_is_refused_without_a_ranks_chunks_and_resume_takes_the_last_good(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path)
    good = await checkpoint(store, 1, 10, [(0, 3), (3, 6)])
    await commit.commit(store, request(1, 10, good))
    before = await commit.read_latest(store, "r")

    refs = await checkpoint(store, 1, 20, [(0, 3), (3, 6)])
    lacking = [f for f in refs if f.name != "rank1.model.safetensors"]
    with pytest.raises(IntegrityError, match="rank 1's shard is incomplete"):
        await commit.commit(store, request(1, 20, lacking))
    gap = await checkpoint(store, 1, 30, [(0, 3), (4, 6)])
    with pytest.raises(IntegrityError, match="do not cover"):
        await commit.commit(store, request(1, 30, gap))
    overlap = await checkpoint(store, 1, 40, [(0, 4), (3, 6)])
    with pytest.raises(IntegrityError, match="overlapping"):
        await commit.commit(store, request(1, 40, overlap))
    for step in (20, 30, 40):  # nothing written for any of them
        with pytest.raises(NotFound):
            await store.get(commit.manifest_key("r", step, 1))
    assert await commit.read_latest(store, "r") == before
    manifest, damaged = await commit.restorable(store, "r")
    assert manifest is not None and manifest.step == 10 and manifest.sharded == ["model"]
    assert not damaged


async def test_a_sharded_commit_under_a_stale_token_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await commit.commit(store, request(2, 10, await checkpoint(store, 2, 10, [(0, 3), (3, 6)])))
    zombie = await checkpoint(store, 1, 20, [(0, 3), (3, 6)])
    with pytest.raises(StaleToken):
        await commit.commit(store, request(1, 20, zombie))
    latest = await commit.read_latest(store, "r")
    assert latest is not None and (latest[0].token, latest[0].step) == (2, 10)


async def test_a_damaged_chunk_after_commit_is_skipped_on_resume(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await commit.commit(store, request(1, 10, await checkpoint(store, 1, 10, [(0, 3), (3, 6)])))
    refs = await checkpoint(store, 1, 20, [(0, 3), (3, 6)])
    await commit.commit(store, request(1, 20, refs))
    victim = store.path(next(f.key for f in refs if f.name == "rank1.model.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    manifest, damaged = await commit.restorable(store, "r")
    assert manifest is not None and manifest.step == 10 and damaged == [20]
