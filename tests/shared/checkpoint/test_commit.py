"""The commit protocol on the file store: write-once manifests, fenced pointer, verification."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save

from baton.runtime.context import RunContext
from shared.checkpoint import commit
from shared.checkpoint.store.file import FileStore
from shared.checkpoint.tensors import flatten, unflatten
from shared.contracts import CommitRequest, FileRef, JobSpec, Task, encode
from shared.errors import (
    AlreadyExists,
    ContractError,
    FinalCommitted,
    IntegrityError,
    NotFound,
    StaleToken,
)


async def files(store: FileStore, run: str, token: int, step: int, payload: bytes) -> list[FileRef]:
    # Commit checks safetensors headers: the payload travels as the file's one tensor.
    payload = save({"payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)})
    key = commit.data_key(run, token, step, "model.safetensors")
    await store.put_once(key, payload)
    digest = hashlib.sha256(payload).hexdigest()
    return [FileRef(name="model.safetensors", key=key, size=len(payload), sha256=digest)]


def request(run: str, token: int, step: int, refs: list[FileRef]) -> CommitRequest:
    return CommitRequest(run_id=run, token=token, step=step, worker="w", files=refs)


async def test_a_second_manifest_for_the_same_checkpoint_is_refused_by_the_store(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path)
    refs = await files(store, "r", 1, 10, b"weights")
    await commit.commit(store, request("r", 1, 10, refs))
    key = commit.manifest_key("r", 10, 1)
    before = await store.get(key)
    with pytest.raises(AlreadyExists):
        await store.put_once(key, encode({"forged": True}))
    assert await store.get(key) == before
    # The same commit again (a redelivery) is idempotent, not a second manifest.
    pointer, _ = await commit.commit(store, request("r", 1, 10, refs))
    assert pointer.step == 10


async def test_lower_token_and_same_token_lower_step_are_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await commit.commit(store, request("r", 5, 20, await files(store, "r", 5, 20, b"a")))
    with pytest.raises(StaleToken):
        await commit.commit(store, request("r", 4, 30, await files(store, "r", 4, 30, b"b")))
    with pytest.raises(StaleToken):
        await commit.commit(store, request("r", 5, 10, await files(store, "r", 5, 10, b"c")))
    await commit.commit(store, request("r", 6, 15, await files(store, "r", 6, 15, b"d")))
    latest = await commit.read_latest(store, "r")
    assert latest is not None and (latest[0].token, latest[0].step) == (6, 15)


async def test_a_final_commit_is_terminal_for_the_store(tmp_path: Path) -> None:
    """Once `latest` is final, nothing follows it: not a higher token (another side that
    trained the same run), not a later step of the same token; a redelivery of the final
    commit itself is still answered with its pointer."""
    store = FileStore(tmp_path)
    final = CommitRequest(
        run_id="r", token=5, step=20, worker="w", files=await files(store, "r", 5, 20, b"a"),
        final=True,
    )  # fmt: skip
    done, _ = await commit.commit(store, final, site="lab1")
    assert done.final and done.site == "lab1" and done.epoch == 0, done
    for token, step in ((1 << 32 | 7, 20), (1 << 40, 30), (5, 25)):
        with pytest.raises(FinalCommitted):
            refs = await files(store, "r", token, step, b"b")
            await commit.commit(store, request("r", token, step, refs))
    assert (await commit.commit(store, final, site="lab1"))[0] == done
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0] == done, latest


async def test_a_sealed_end_refuses_every_commit_after_it(tmp_path: Path) -> None:
    """A run cancelled at the hub: `latest` keeps naming its checkpoint, and no side, under
    any token, commits after it; sealing again changes nothing, and a final chain is never
    sealed."""
    store = FileStore(tmp_path)
    refs = await files(store, "r", 5, 10, b"a")
    done, _ = await commit.commit(store, request("r", 5, 10, refs))
    assert await commit.seal(store, "r", "cancelled")
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0].ended == "cancelled", latest
    assert latest[0].checkpoint == done.manifest and latest[0].token == 5, latest
    for token, step, site in ((5, 20, ""), (1 << 40, 10, "lab1")):
        with pytest.raises(FinalCommitted, match="cancelled"):
            more = await files(store, "r", token, step, b"b")
            await commit.commit(store, request("r", token, step, more), site=site)
    assert await commit.seal(store, "r", "cancelled")
    # Cancelled before any checkpoint: a seal alone, which refuses a first commit too.
    assert await commit.seal(store, "q", "cancelled")
    with pytest.raises(FinalCommitted):
        await commit.commit(store, request("q", 1, 1, await files(store, "q", 1, 1, b"c")))
    # A run trained to the end is complete, never sealed as cancelled.
    final = msgspec.structs.replace(
        request("f", 1, 5, await files(store, "f", 1, 5, b"d")), final=True
    )
    await commit.commit(store, final)
    assert not await commit.seal(store, "f", "cancelled")


async def test_racing_committers_leave_one_increasing_lineage(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    reqs = [
        request("r", t, s, await files(store, "r", t, s, f"{t}-{s}".encode()))
        for t in (1, 2, 3)
        for s in (10, 20)
    ]

    async def attempt(req: CommitRequest) -> None:
        with contextlib.suppress(StaleToken):
            await commit.commit(store, req)

    await asyncio.gather(*(attempt(r) for r in reversed(reqs)))
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0].token == 3


async def test_a_flipped_bit_fails_verification_and_resume_walks_back(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await commit.commit(store, request("r", 1, 10, await files(store, "r", 1, 10, b"good" * 100)))
    refs = await files(store, "r", 1, 20, b"also good" * 100)
    path = tmp_path / refs[0].key
    data = bytearray(path.read_bytes())
    data[50] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        await commit.commit(store, request("r", 1, 20, refs))
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0].step == 10
    # Damage after commit: restore skips it and names it.
    await commit.commit(store, request("r", 1, 30, await files(store, "r", 1, 30, b"x" * 64)))
    (tmp_path / commit.data_key("r", 1, 30, "model.safetensors")).write_bytes(b"y" * 64)
    manifest, damaged = await commit.restorable(store, "r")
    assert manifest is not None and manifest.step == 10 and damaged == [30]


async def test_files_outside_the_checkpoint_prefix_are_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    refs = await files(store, "other", 1, 10, b"theirs")
    with pytest.raises(ContractError):
        await commit.commit(store, request("r", 1, 10, refs))


def test_optimizer_state_round_trips_exactly_without_pickle() -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten(opt.state_dict(), "optimizer", tensors)
    back = unflatten(tree, tensors)
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    assert back["param_groups"][0]["betas"] == (0.8, 0.95)
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(back["state"][k][name], t)
    tree2 = flatten({"x": float("inf")}, "m", {})
    assert unflatten(tree2, {}) == {"x": float("inf")}


# -- a checkpoint of several ranks ---------------------------------------------------------


async def shards(
    store: FileStore, run: str, token: int, step: int, names: list[str]
) -> list[FileRef]:
    """Files of a checkpoint, one per name: a tensor file holds one tensor, meta.json `{}`."""
    refs = []
    for name in names:
        if name.endswith(".safetensors"):
            data = save({"x": torch.full((2,), float(len(refs)))})
        else:
            data = b"{}"
        key = commit.data_key(run, token, step, name)
        await store.put_once(key, data)
        refs.append(FileRef(name=name, key=key, size=len(data),
                            sha256=hashlib.sha256(data).hexdigest()))  # fmt: skip
    return refs


RANK0 = ["meta.json", "rng.safetensors", "model.safetensors", "data.safetensors"]
RANK1 = ["rank1.meta.json", "rank1.rng.safetensors", "rank1.data.safetensors"]


@pytest.mark.parametrize(
    ("ranks", "names", "needle"),
    [
        (2, RANK0, "rank 1's shard is incomplete: no rank1.meta.json"),
        (2, RANK0 + RANK1[:1], "rank 1's shard is incomplete: no rank1.rng.safetensors"),
        (2, RANK0[1:] + RANK1, "rank 0's shard is incomplete: no meta.json"),
        (3, RANK0 + RANK1, "rank 2's shard is incomplete: no rank2.meta.json"),
        (2, [*RANK0, *RANK1, "rank2.meta.json"], "rank2.meta.json belongs to no rank"),
        (1, RANK0 + RANK1, "rank1.data.safetensors belongs to no rank of a group of 1"),
    ],
    ids=["no-rank-1", "rank-1-without-rng", "no-rank-0-meta", "3-ranks", "a-stray-rank", "1-rank"],
)
async def test_a_commit_lacking_a_ranks_shard_is_refused_and_writes_nothing(
    tmp_path: Path, ranks: int, names: list[str], needle: str
) -> None:
    """Refused as `IntegrityError` (the checkpointer tells the trainer: commit_refused),
    before anything is written: no manifest, and `latest` still names the last commit."""
    store = FileStore(tmp_path)
    good = await shards(store, "r", 1, 10, RANK0 + RANK1)
    await commit.commit(store, msgspec.structs.replace(request("r", 1, 10, good), ranks=2))
    before = await commit.read_latest(store, "r")
    refs = await shards(store, "r", 1, 20, names)
    with pytest.raises(IntegrityError, match=needle):
        await commit.commit(store, msgspec.structs.replace(request("r", 1, 20, refs), ranks=ranks))
    with pytest.raises(NotFound):
        await store.get(commit.manifest_key("r", 20, 1))
    assert await commit.read_latest(store, "r") == before


async def test_a_checkpoint_of_two_ranks_resumes_only_at_two(tmp_path: Path) -> None:
    """The manifest records the group's size; resuming at another size is refused by name,
    by the protocol's check and by a real single-rank RunContext alike."""
    store = FileStore(tmp_path)
    refs = await shards(store, "r", 1, 10, RANK0 + RANK1)
    await commit.commit(store, msgspec.structs.replace(request("r", 1, 10, refs), ranks=2))
    manifest, damaged = await commit.restorable(store, "r")
    assert manifest is not None and manifest.ranks == 2 and not damaged
    commit.check_ranks(manifest, 2)
    for other in (1, 3):
        with pytest.raises(IntegrityError, match=f"written by 2 rank\\(s\\).*resumed by {other}"):
            commit.check_ranks(manifest, other)
    spec = JobSpec(name="t", entry_point="m:f", total_steps=20)
    ctx = RunContext(Task(run_id="r", spec=spec), 2, store.url, tmp_path / "spool", [].append)
    try:
        with pytest.raises(IntegrityError, match="written by 2 rank"):
            await asyncio.to_thread(ctx.restore, model=torch.nn.Linear(2, 2))
    finally:
        ctx.close()
    # A manifest of one rank (as every manifest before groups) still resumes at one.
    single = await shards(store, "s", 1, 10, RANK0)
    await commit.commit(store, request("s", 1, 10, single))
    manifest, _ = await commit.restorable(store, "s")
    assert manifest is not None and manifest.ranks == 1
    commit.check_ranks(manifest, 1)
