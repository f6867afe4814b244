"""FSDP2 runs (`examples/fsdp_lm.py`: a small transformer LM, AdamW, `fully_shard` per block
and at the root) as real training processes on gloo: every rank writes its own chunks, one
commit holds them all, a run resumes at its size on the same bits and at another size
reading only the rows each rank owns now.

The test plays the trainers and the checkpointer (`tests.support.child_group`), on a file
store whose ranged reads are the same code path as S3's for the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from services.trainer.child_proc import Zygote
from shared.checkpoint import commit
from shared.checkpoint.shards import SHARDING_KEY
from shared.contracts import JobSpec, convert
from shared.contracts.child import CheckpointReady, Control, Finished, Loaded, StepDone
from tests.support.child_group import Group, started, zygote

__all__ = ["zygote"]  # the fixture, used by name

pytestmark = pytest.mark.slow


def fsdp(
    total: int, *, ranks: Any = 2, every: int = 10, entry: str = "examples.fsdp_lm:train",
    **config: Any,
) -> JobSpec:  # fmt: skip
    return convert(
        {
            "name": "fsdp", "entry_point": entry, "total_steps": total,
            "deterministic": True, "seed": 11, "ranks": ranks, "collective_timeout_s": 30,
            "checkpoint": {"every_steps": every},
            "config": {"layers": 2, "dim": 32, "heads": 2, "window": 16, "batch": 6, **config},
        },
        JobSpec,
    )  # fmt: skip


async def test_a_killed_rank_resumes_at_its_size_on_the_same_bits(
    tmp_path: Path, zygote: Zygote
) -> None:
    """Two ranks, one SIGKILLed mid-run: the group breaks, the checkpoints rank 0 handed
    over before are committed, and a new group of two resumes from the newest and ends on
    the bits of an uninterrupted run — each rank having written only its own chunks."""
    spec = fsdp(40)
    whole = Group(tmp_path / "whole", zygote, "fsdp-whole", spec)
    ranks = await whole.start()
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    await whole.commit(ranks[0])
    reference = ranks[0].of(CheckpointReady)[-1]
    assert reference.final and reference.sharded == ["model", "optimizer"]
    names = {f.name for f in reference.files}
    assert {"model.safetensors", "rank1.model.safetensors"} <= names
    assert {"optimizer.safetensors", "rank1.optimizer.safetensors"} <= names
    shard = whole.store.path(next(f.key for f in reference.files if f.name == "model.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        offsets = json.loads(f.metadata()[SHARDING_KEY])
        rows = f.get_slice("model.embed.weight").get_shape()[0]
    assert offsets["model.embed.weight"] == {"saved_offsets": [0, 0]}
    rank1 = whole.store.path(
        next(f.key for f in reference.files if f.name == "rank1.model.safetensors")
    )
    with safe_open(str(rank1), framework="pt") as f:  # rank 1's chunk starts where 0's ends
        assert json.loads(f.metadata()[SHARDING_KEY])["model.embed.weight"] == {
            "saved_offsets": [rows, 0]
        }

    run = Group(tmp_path / "run", zygote, "fsdp-run", fsdp(40, pace=0.02))
    ranks = await run.start()
    await ranks[0].until(CheckpointReady, lambda m: m.step >= 20)
    ranks[1].child.kill()
    await ranks[0].exit_code()
    await ranks[1].exit_code()
    await run.commit(ranks[0])
    latest = await commit.read_latest(run.store, "fsdp-run")
    assert latest is not None and 20 <= latest[0].step < 40

    ranks = await run.start()
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    assert ranks[0].of(Loaded)[0].step == latest[0].step
    assert ranks[0].of(Loaded)[0].resharded_from == 0
    final = ranks[0].of(CheckpointReady)[-1]
    assert final.final and final.digest == reference.digest, "the resumed weights differ"
    assert final.metrics == reference.metrics


async def test_a_checkpoint_of_two_ranks_resumes_at_one_and_at_three_reading_its_rows(
    tmp_path: Path, zygote: Zygote
) -> None:
    """An elastic FSDP2 run stopped at two ranks commits both ranks' chunks; resumed from
    that commit at one rank and at three, every parameter and AdamW value is what the two
    held when they stopped, bit for bit, and at three each rank read only about a third of
    the shard bytes (its rows), not the whole."""
    dump = tmp_path / "dump"
    dump.mkdir()
    probe = "tests.support.workloads:fsdp_probe"
    spec = fsdp(30, ranks={"min": 1, "max": 3}, every=1000, entry=probe, pace=0.02, dump=str(dump))
    run = Group(tmp_path / "two", zygote, "fsdp-elastic", spec)
    ranks = await run.start(2)
    await ranks[1].until(StepDone, lambda m: m.step >= 8)
    ranks[0].child.send(Control(action="stop"))
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    assert all(r.of(Finished)[-1].stopped for r in ranks)
    (ready,) = ranks[0].of(CheckpointReady)
    assert ready.ranks == 2 and ready.sharded == ["model", "optimizer"]
    await run.commit(ranks[0])
    stopped = load_file(dump / "1-stopped.safetensors")
    sharded = ("model.safetensors", "optimizer.safetensors")
    shard_bytes = sum(f.size for f in ready.files if f.name.endswith(sharded))

    for size in (1, 3):
        copy = Group(tmp_path / f"at{size}", zygote, "fsdp-elastic", spec)
        copy.store, copy.epoch = run.store, run.epoch  # resumes the same commit
        ranks = await copy.start(size)
        assert [await r.exit_code() for r in ranks] == [0] * size, [r.output() for r in ranks]
        assert_same(load_file(dump / f"{copy.epoch}-restored.safetensors"), stopped)
        loaded = [r.of(Loaded)[0] for r in ranks]
        assert all(m.resharded_from == 2 and m.step == ready.step for m in loaded), loaded
        read = [m.read_bytes for m in loaded]
        if size == 3:  # each its third of the rows, headers and rounding aside
            assert all(b < 0.5 * shard_bytes for b in read), (read, shard_bytes)
        assert sum(read) < 1.2 * shard_bytes, (read, shard_bytes)
        assert "not bitwise the run at the old size" in ranks[0].output()
        run.epoch = copy.epoch


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


async def test_a_pulled_sharded_checkpoint_loads_with_plain_dcp_and_gathers_whole(
    tmp_path: Path, zygote: Zygote
) -> None:
    """`baton pull` of a two-rank FSDP2 checkpoint: each sharded object's shards form a
    directory plain DCP (`HuggingFaceStorageReader`) loads into an unsharded model in one
    process, and `--gather` assembles the same tensors into one file."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load

    from baton.client import calls as client
    from examples.fsdp_lm import LM

    spec = fsdp(12)
    group = Group(tmp_path / "run", zygote, "fsdp-pull", spec)
    ranks = await group.start()
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    await group.commit(ranks[0])
    dest = tmp_path / "pulled"
    info = await client.pull(group.store.url, "fsdp-pull", dest, whole=True)
    assert info["final"] and {"model/", "optimizer/", "model.whole.safetensors"} <= set(
        info["files"]
    )
    assert info["digest"] == ranks[0].of(CheckpointReady)[-1].digest
    gathered = load_file(dest / "model.whole.safetensors")

    plain = LM(vocab=gathered["model.head.weight"].shape[0], dim=32, layers=2, heads=2, window=16)
    state = {f"model.{k}": torch.zeros_like(v) for k, v in plain.state_dict().items()}
    dcp_load(state, storage_reader=HuggingFaceStorageReader(str(dest / "model")), no_dist=True)
    assert_same(state, gathered)
    assert not any(torch.equal(v, torch.zeros_like(v)) for v in state.values() if v.numel() > 1)


async def test_a_ranks_peak_memory_on_save_and_load_is_its_shard_not_the_whole(
    tmp_path: Path,
) -> None:
    """Three ranks of a larger model (~30 MB of weights, ~90 MB with AdamW's state): the
    peak resident memory each rank adds while it loads a checkpoint, and while it takes one
    and writes it through, stays near the bytes of its own shard — a third of the whole —
    and far below the whole, which no rank ever holds."""
    dump = tmp_path / "dump"
    dump.mkdir()
    big = {"layers": 4, "dim": 384, "heads": 4, "window": 16, "batch": 6}
    spec = fsdp(6, ranks=3, every=1000, entry="tests.support.workloads:fsdp_memory",
                save_at=2, dump=str(dump), **big)  # fmt: skip
    # Every allocation of 64 KiB or more is its own mapping, returned when freed: resident
    # memory is then what is live, not what the allocator keeps from freed training buffers.
    async with started(tmp_path, MALLOC_MMAP_THRESHOLD_="65536") as zygote:
        group = Group(tmp_path / "run", zygote, "fsdp-memory", spec)
        ranks = await group.start(3)
        await ranks[0].until(CheckpointReady, lambda m: m.step == 2)  # `save` is measured
        ranks[0].child.send(Control(action="stop"))
        assert [await r.exit_code() for r in ranks] == [0] * 3, [r.output() for r in ranks]
        await group.commit(ranks[0])
        ranks = await group.start(3)  # resumes: `load` is measured on a real checkpoint
        assert [await r.exit_code() for r in ranks] == [0] * 3, [r.output() for r in ranks]
    for k in range(3):
        m = json.loads((dump / f"memory-1-rank{k}.json").read_text())
        m.update(
            {
                k: v
                for k, v in json.loads((dump / f"memory-2-rank{k}.json").read_text()).items()
                if k.startswith("load")
            }
        )
        assert m["whole"] > 2.9 * m["shard"] > 60e6, m
        # Loading sets AdamW's state up (two thirds of the shard, kept) and reads the rows;
        # saving copies the shard into host buffers (kept for the next checkpoint) and
        # writes them. What either needs beyond what it keeps is a fraction of a shard.
        assert m["load"] < 1.5 * m["shard"] and m["save"] < 1.5 * m["shard"], m
        assert m["load_transient"] < 0.5 * m["shard"], m
        assert m["save_transient"] < 0.5 * m["shard"], m


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_as_it_was(
    tmp_path: Path,
) -> None:
    """torch sets an optimizer's state up to describe it; a checkpoint taken before the
    first step undoes that and saves no state, and loading it leaves the optimizer fresh:
    the next step is its first, as in a run that took no checkpoint (AdamW's bias
    correction counts from it)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from baton.runtime.shards import load_sharded
    from baton.runtime.slots import ShardedOptimizerSlot, slots_for

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=0.1)

        def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
            for i in range(3):
                model(torch.full((2, 4), float(i))).sum().backward()
                opt.step()
                opt.zero_grad()
            return [p.full_tensor().detach().clone() for p in model.parameters()]

        want = train(*build())
        model, opt = build()
        slots = slots_for({"model": model, "optimizer": opt})
        slot = slots[1]
        assert isinstance(slot, ShardedOptimizerSlot) and slots[0].sharded
        whole: dict[str, torch.Tensor] = {}
        tree = slot.capture(whole)
        assert not whole and not opt.state, "the set-up was saved or left in place"
        state, _ = load_sharded(f"file://{tmp_path}", [], "optimizer", tree, slot.target())
        slot.put(state)
        assert not opt.state
        assert all(torch.equal(a, b) for a, b in zip(train(model, opt), want, strict=True))
    finally:
        dist.destroy_process_group()
