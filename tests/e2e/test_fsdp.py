"""FSDP2 runs end to end: `examples/fsdp_lm.py` (a small transformer LM, AdamW, sharded with
`fully_shard`) on real trainers under `baton up`'s default authorization, gloo on CPU.

A two-rank run whose rank is SIGKILLed mid-run resumes at two ranks on the bits of an
uninterrupted run. An elastic run of one to three ranks loses a trainer (3 -> 2), another
(2 -> 1), gets two back (1 -> 3) and completes: each resize resumes from a committed
checkpoint of another size, its loss goes on where it was, and each rank reads only the
byte ranges of the rows it owns at the new size.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    CheckpointCommitted,
    Diverged,
    GroupFormed,
    Progress,
    RankLost,
    Resized,
    Restored,
)
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack, attempt_processes, eventually, named_trainers

pytestmark = [pytest.mark.slow, pytest.mark.frameworks, pytest.mark.asyncio(loop_scope="module")]

MODEL = {"layers": 2, "dim": 32, "heads": 2, "window": 16, "batch": 6}


def fsdp(key: str, *, total: int, ranks: Any, **config: Any) -> JobSpec:
    return job(
        name="fsdp", entry_point="examples.fsdp_lm:train", total_steps=total, ranks=ranks,
        seed=11, checkpoint={"every_steps": 10}, config={**MODEL, **config},
        idempotency_key=key,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with named_trainers(tmp_path_factory.mktemp("fsdp"), ("f1", "f2", "f3")) as s:
        yield s


async def test_a_rank_killed_mid_run_resumes_at_two_ranks_on_the_same_bits(pool: Stack) -> None:
    nc = await pool.client()
    ref_id = await submit(nc, fsdp("reference", total=60, ranks=2))
    reference = await finished(nc, ref_id, timeout=180)
    assert reference.state is RunState.COMPLETED and reference.digest, reference.reason

    run_id = await submit(nc, fsdp("killed", total=60, ranks=2, pace=0.05))
    log = EventLog(nc, run_id)
    formed = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and len(e.members) == 2, 90, "a group of two"
    )
    assert isinstance(formed, GroupFormed)
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted) and e.step >= 20, 90, "commit")
    victims = attempt_processes(pool.pid(formed.members[1]))
    assert victims, "rank 1's trainer has no training process"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    await log.wait_for(lambda e: isinstance(e, RankLost), 60, "the rank's loss")
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == reference.digest, "the resumed run's weights differ"
    resumed = [e for e in log.of(Restored) if e.step > 0]
    assert resumed and all(e.resharded_from == 0 for e in resumed)
    # The deterministic run's own witness: the resumed steps reported what the first
    # attempt reported after the same checkpoint.
    assert not log.of(Diverged)
    log.close()


async def test_an_elastic_run_shrinks_to_one_and_grows_to_three_reading_only_its_rows(
    pool: Stack,
) -> None:
    nc = await pool.client()
    run_id = await submit(nc, fsdp("elastic", total=400, ranks={"min": 1, "max": 3}, pace=0.05))
    log = EventLog(nc, run_id)
    first = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and len(e.members) == 3, 90, "a group of three"
    )
    assert isinstance(first, GroupFormed)
    epoch, survivor = first.epoch, first.worker
    for lost, to in ((first.members[2], 2), (first.members[1], 1)):
        await log.wait_for(
            lambda e, k=epoch: isinstance(e, CheckpointCommitted) and e.token == k, 90, "commit"
        )
        pool.signal(lost, signal.SIGKILL)  # the trainer, for good: no spare is free
        shrunk = await log.wait_for(
            lambda e, k=epoch, n=to: isinstance(e, Resized) and e.epoch > k and e.to_ranks == n,
            90,
            f"the shrink to {to}",
        )
        assert isinstance(shrunk, Resized)
        epoch, survivor = shrunk.epoch, shrunk.worker
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.token == epoch, 90, "one rank's commit"
    )
    # The one rank left is held (SIGSTOP) while two trainers start and one of them holds the
    # offer to grow, so that the run cannot reach its end first however fast or slow the
    # machine is: it grows at its next step boundary once it goes on.
    held = attempt_processes(pool.pid(survivor))
    assert held, "the surviving rank has no training process"
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        await pool.add_trainer("f4")
        await pool.add_trainer("f5")

        async def offer_held() -> bool:
            return any("offered to grow its group" in pool.log(w) for w in ("f4", "f5"))

        await eventually(offer_held, 90, "a new trainer to hold the offer to grow")
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    await log.wait_for(
        lambda e: isinstance(e, Resized) and e.epoch > epoch and e.to_ranks == 3, 120, "grown to 3"
    )
    record = await finished(nc, run_id, timeout=300)
    assert record.state is RunState.COMPLETED, record.reason

    # Every resize resumed a checkpoint of another size, reading the rows it owns now: at
    # one rank everything, at three about a third each (rank 0's count is in its event).
    sizes = [(e.from_ranks, e.to_ranks) for e in log.of(Resized)]
    assert (3, 2) in sizes and (2, 1) in sizes and sizes[-1][1] == 3, sizes
    restored = [e for e in log.of(Restored) if e.resharded_from]
    assert {e.resharded_from for e in restored} >= {3, 2}, restored
    stored = {e.step: e.bytes for e in log.of(CheckpointCommitted)}
    size_at = {e.step: e.to_ranks for e in log.of(Resized)}
    for e in restored:
        share = e.read_bytes / stored[e.step]  # of everything the checkpoint stored
        assert (share > 0.6) if size_at[e.step] == 1 else (share < 0.55), (e, stored, size_at)
    reads = [line for name in ("f1", "f2", "f3", "f4", "f5") for line in _reads(pool, name, run_id)]
    assert reads, "no rank logged the byte ranges it read"

    # The loss goes on where it was at each resize: no jump back towards a fresh model's.
    losses = {e.step: e.metrics["loss"] for e in log.of(Progress) if "loss" in e.metrics}
    start = losses[min(losses)]
    for e in restored:
        before = [v for s, v in losses.items() if e.step - 20 <= s <= e.step]
        after = [v for s, v in losses.items() if e.step < s <= e.step + 20]
        assert before and after, (e.step, sorted(losses))
        assert max(after) < start and _mean(after) < 1.3 * _mean(before), (e.step, before, after)
    log.close()


def _reads(pool: Stack, worker: str, run_id: str) -> list[str]:
    path = pool.root / "work" / worker / "logs" / f"{run_id}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return re.findall(r"baton: (?:model|optimizer): read \S+ bytes [0-9 -]+", text)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
