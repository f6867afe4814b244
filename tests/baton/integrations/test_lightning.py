"""Lightning under Baton, end to end: `examples/lightning_lm.py` (a `LightningModule`, a
`LightningDataModule`, `Trainer.fit`, and `baton.integrations.lightning`) on real trainers
that are SIGKILLed and SIGTERMed, on one rank and on two (Lightning's DDP on Baton's
group, gloo on CPU).

One stack for the module: three trainers, restarted when they die as `baton up` does. Every
run is compared with the uninterrupted run of the same job, bit for bit: the weights'
digest, and the resume self-check (no `Diverged` event). The jobs validate every 7 steps
and cross epoch boundaries (29 steps an epoch on one rank, 15 on each of two), so what runs
between training steps and a new epoch's shuffle are part of what must resume exactly.

Without a stack: tests/baton/integrations/test_lightning_loop.py.
"""

from __future__ import annotations

import math
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client

from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import (
    AttemptFailed,
    CheckpointCommitted,
    Diverged,
    GroupFormed,
    Preempted,
    Progress,
    RankLost,
    Restored,
    Started,
)
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack, all_dead, attempt_processes, named_trainers

pytestmark = [
    pytest.mark.slow,
    # Lightning 2.6's own use of torch's pytree API, nothing of ours.
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]
on_the_stack = pytest.mark.asyncio(loop_scope="module")

TRAINERS = ("t1", "t2", "t3")
EVERY = 10
SMALL = {"stride": 24, "batch": 8, "dim": 32, "heads": 2, "warmup": 5, "val_every": 7,
         "val_batches": 2}  # fmt: skip


def lm(key: str, *, total: int = 60, ranks: int = 1, every: int = EVERY, **config: Any) -> JobSpec:
    """The example, small: 225 training windows, 8 a batch (per rank)."""
    return job(
        name="lightning-lm",
        entry_point="examples.lightning_lm:train",
        total_steps=total,
        ranks=ranks,
        seed=21,
        checkpoint={"every_steps": every},
        config={**SMALL, "steps_sleep": 0.05, **config},
        idempotency_key=key,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def three(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with named_trainers(tmp_path_factory.mktemp("lightning"), TRAINERS, restart=True) as s:
        yield s


_reference: dict[int, RunRecord] = {}


async def reference(nc: Client, ranks: int = 1) -> RunRecord:
    """The uninterrupted run of the job (the pace changes no arithmetic)."""
    if ranks not in _reference:
        total = 60 if ranks == 1 else 40
        run_id = await submit(nc, lm(f"reference-{ranks}", total=total, ranks=ranks,
                                     steps_sleep=0.0))  # fmt: skip
        record = await finished(nc, run_id, timeout=180)
        assert record.state is RunState.COMPLETED, record.reason
        assert record.digest and record.attempts == 1, record
        _reference[ranks] = record
    return _reference[ranks]


@on_the_stack
async def test_the_logged_loss_is_the_runs_metric(three: Stack) -> None:
    """`self.log("loss", ...)` in `training_step` (and `val_loss` in `validation_step`)
    reach Baton: every `Progress` event carries the loss of its step, the record the last
    one, and the loss falls as the model learns."""
    nc = await three.client()
    record = await reference(nc)
    events = await history(nc, record.run_id)
    progress = [e for e in events if isinstance(e, Progress)]
    assert progress and all("loss" in e.metrics for e in progress), progress[:3]
    first, last = progress[0].metrics["loss"], record.metrics["loss"]
    assert all(math.isfinite(v) for v in (first, last)), (first, last)
    assert last < first - 0.5, f"the loss went from {first} to {last}"
    assert progress[-1].step == 60 and progress[-1].metrics["loss"] == last, progress[-1]
    assert "val_loss" in record.metrics, record.metrics
    assert not [e for e in events if isinstance(e, Diverged)]


@on_the_stack
async def test_sigkill_resumes_on_another_trainer_bitwise_equal(three: Stack) -> None:
    nc = await three.client()
    want = (await reference(nc)).digest
    run_id = await submit(nc, lm("kill"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the start")
    assert isinstance(first, Started)
    commit = await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 2 * EVERY, 60, "a commit"
    )
    assert isinstance(commit, CheckpointCommitted)
    # Past the checkpoint's witness (3 steps), so the resumed attempt checks itself.
    reached = await log.wait_for(
        lambda e: isinstance(e, Progress) and e.step >= commit.step + 5, 60, "steps past it"
    )
    assert isinstance(reached, Progress) and reached.step < 60
    family = attempt_processes(three.pid(first.worker))
    three.signal(first.worker, signal.SIGKILL)
    await all_dead(family, "the killed trainer's training process")

    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == want, "the resumed run's weights differ from the uninterrupted run's"
    second = next(e for e in log.of(Started) if e.token > first.token)
    resumed = next(e for e in log.of(Restored) if e.at >= second.at)
    committed = {e.step for e in log.of(CheckpointCommitted)}
    assert resumed.step in committed and commit.step <= resumed.step <= reached.step, resumed
    assert not log.of(Diverged), log.of(Diverged)
    assert record.retries == 0 and not log.of(AttemptFailed)
    log.close()


@on_the_stack
async def test_sigterm_saves_within_the_grace_and_loses_no_step(three: Stack) -> None:
    """No checkpoint is due by the job's policy (the reference took them every 10 steps,
    which changes nothing in its arithmetic): the only commit is the one the callback saved
    when told to stop. Had the grace run out, the process would have been killed with
    nothing saved, and the run resumed from step 0."""
    nc = await three.client()
    want = (await reference(nc)).digest
    run_id = await submit(nc, lm("term", every=1000))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the start")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 23, 60, "step 23")
    family = attempt_processes(three.pid(first.worker))
    three.signal(first.worker, signal.SIGTERM)

    pre = await log.wait_for(lambda e: isinstance(e, Preempted), 60, "the preemption")
    assert isinstance(pre, Preempted) and pre.worker == first.worker and pre.step >= 23, pre
    saved = [e for e in log.of(CheckpointCommitted) if e.token == first.token]
    assert [e.step for e in saved] == [pre.step], saved
    await all_dead(family, "the preempted training process")
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.at > pre.at, 60, "the resume"
    )
    assert isinstance(resumed, Restored) and resumed.step == pre.step  # zero lost steps
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED and record.digest == want, record
    assert not log.of(Diverged) and record.retries == 0
    log.close()


@on_the_stack
async def test_two_ranks_survive_a_lost_rank_bitwise_equal(three: Stack) -> None:
    nc = await three.client()
    want = (await reference(nc, ranks=2)).digest
    run_id = await submit(nc, lm("kill-rank", total=40, ranks=2))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, GroupFormed), 90, "the group")
    assert isinstance(first, GroupFormed) and len(set(first.members)) == 2
    commit = await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= EVERY, 90, "a commit"
    )
    assert isinstance(commit, CheckpointCommitted)
    await log.wait_for(
        lambda e: isinstance(e, Progress) and e.step >= commit.step + 4, 60, "steps past it"
    )
    leader_child = attempt_processes(three.pid(first.members[0]))

    # Rank 1's trainer dies: rank 0's DDP fails in a collective, the group forms again on
    # the spare trainer, and every rank resumes from its own files of the last commit.
    three.signal(first.members[1], signal.SIGKILL)
    lost = await log.wait_for(lambda e: isinstance(e, RankLost), 60, "the rank's loss")
    assert isinstance(lost, RankLost) and (lost.rank, lost.lost) == (1, first.members[1])
    await all_dead(leader_child, "rank 0's process of the broken group")
    second = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > first.epoch, 90, "the group again"
    )
    assert isinstance(second, GroupFormed)
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == want, "the resumed group's weights differ from the uninterrupted run's"
    committed = {e.step for e in log.of(CheckpointCommitted)}
    resumed = [e for e in log.of(Restored) if e.at >= second.at]
    assert resumed and all(e.step in committed and e.step >= commit.step for e in resumed)
    assert record.retries == 0 and not log.of(AttemptFailed)  # never the user's failure
    assert not log.of(Diverged), log.of(Diverged)
    log.close()


# -- without a stack: a Lightning script driven in-process -------------------------------
# The real RunContext, writer and commit protocol on a file store (tests/baton/harness.py);
# an attempt "dies" when a callback raises mid-step, as a killed process would stop.
