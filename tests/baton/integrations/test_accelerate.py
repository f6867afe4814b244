"""Hugging Face Accelerate under Baton (`baton.integrations.accelerate`), end to end: the
example loop (`examples/accelerate_lm.py`: a GPT-2 built from its config, a shuffling
`DataLoader`, AdamW and a schedule, all through `accelerator.prepare`) on a real stack —
nats-server, dispatcher, checkpointer, reaper and trainers as processes, each attempt a
training process of its own.

What it proves, each against an uninterrupted run of the same job: a run whose trainer is
SIGKILLed mid-run resumes on another from Accelerate's own checkpoint files and ends with
the same weights, bit for bit; a SIGTERMed one saves (`save_state`) within the grace and
the next attempt starts at the very step it stopped at; a 2-rank run (DDP through
Accelerate, gloo) that loses a rank's trainer forms again on the spare and ends with the
weights of the uninterrupted 2-rank run. Along the way, the loss the loop reports reaches
the run's `Progress` events and record, and no resume is reported as diverged (the
self-check compares a resumed attempt's first losses with the first attempt's).

Three trainers, not restarted when they die; a test that kills one starts another, so each
test finds three.

Before those, in this process and in seconds, what the example does not reach: a loop of
its own with gradient accumulation over epochs that end part-way through an accumulation,
torchdata's stateful data loader as well as skipped batches, resumes mid-epoch and at an
epoch's end — the real `RunContext` and Accelerate, attempts that stop drawing steps ('die')
and resume from what the commit protocol committed on a file store — and the mistakes
refused.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from accelerate.state import AcceleratorState, GradientState  # type: ignore[import-untyped]
from accelerate.utils import (  # type: ignore[import-untyped]
    DataLoaderConfiguration,
    ProjectConfiguration,
)
from torch.utils.data import DataLoader, TensorDataset

from baton.integrations.accelerate import AcceleratedRun, make_accelerator
from baton.runtime import witness
from baton.runtime.context import RunContext
from shared.checkpoint.digest import weights_digest
from shared.contracts import JobSpec, RunRecord, RunState, Task, convert
from shared.contracts.child import CheckpointReady, Divergence, FromChild, Loaded
from shared.contracts.events import (
    CheckpointCommitted,
    Diverged,
    GroupFormed,
    Preempted,
    Progress,
    RankLost,
    Restored,
    Started,
)
from tests.baton.harness import RUN, Run
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack, all_dead, attempt_processes, children_of, named_trainers

end_to_end = pytest.mark.asyncio(loop_scope="module")
"""The stack's tests share the module's event loop (its fixtures are the module's)."""

# -- in this process: a loop of its own ------------------------------------------------

STEPS, ACCUMULATE, ASKED = 16, 3, (6, 12)
"""37 samples in batches of 4 are 10 batches an epoch, 4 optimizer steps of 3, 3, 3 and 1
batches (Accelerate steps at an epoch's end whatever it accumulated). Checkpoints are asked
for (as a trainer asks) at steps 6, mid-epoch, and 12, an epoch's end: periodic ones move to
a later step while the one before is still being written."""


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """Accelerate's state is the process's (a training process has one run); these tests
    make one per attempt, single-threaded as a deterministic run is, and leave none."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch.set_num_threads(threads)


def attempt(
    run: Run, stateful: bool, until: int | None = None
) -> tuple[list[FromChild], str, dict[str, Any]]:
    """One attempt of a small Accelerate loop under Baton, 'dying' after step `until`: the
    messages its training process would send, its weights' digest, what it saw."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(run.job.seed)  # as a training process starts (services/trainer/child.py)
    np.random.seed(run.job.seed)
    random.seed(run.job.seed)
    run.token += 1
    sent: list[FromChild] = []
    ctx = RunContext(
        Task(run_id=RUN, spec=run.job), run.token, run.store_url, run.root / "spool", sent.append
    )
    accelerator = make_accelerator(
        ctx,
        gradient_accumulation_steps=ACCUMULATE,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=ctx.seed, use_stateful_dataloader=stateful
        ),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    loop = AcceleratedRun(ctx, accelerator, model)
    start = loop.resume()
    epochs: list[int] = []
    try:
        for xb, yb in loop.batches(loader):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            epochs.append(loop.epoch)
            if ctx.step + 1 in ASKED:
                ctx.request("checkpoint")
            at = loop.step_ended(loss=loss.item())
            if at.stop or (until is not None and at.step >= until):
                break
    finally:
        ctx.close()
    for ready in (m for m in sent if isinstance(m, CheckpointReady)):
        run.commit(ready)
    digest = weights_digest(accelerator.unwrap_model(model).state_dict())
    return sent, digest, {"start": start, "epochs": epochs}


def job_spec() -> JobSpec:
    return convert(
        {"name": "unit", "entry_point": "m:f", "total_steps": STEPS, "seed": 7,
         "deterministic": True, "checkpoint": {"every_steps": 1000}},
        JobSpec,
    )  # fmt: skip


@pytest.mark.parametrize("stateful", [False, True], ids=["skipped-batches", "stateful-loader"])
def test_a_loop_of_its_own_resumes_mid_epoch_and_at_an_epochs_end_bit_for_bit(
    tmp_path: Path, accelerate_state: None, stateful: bool
) -> None:
    whole = Run(tmp_path / "whole", job_spec())
    sent, want, saw = attempt(whole, stateful)
    ready = [m for m in sent if isinstance(m, CheckpointReady)]
    assert [r.step for r in ready][-1] == STEPS and ready[-1].final and ready[-1].digest == want
    assert [r.step for r in ready] == [*ASKED, STEPS]
    assert saw["epochs"] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    names = {f.name for f in ready[-1].files}
    accelerate = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"]
    expected = {"meta.json", "rng.safetensors", *(f"file.{n}" for n in accelerate)}
    expected.add("file.baton_position.json")
    assert names == expected | ({"file.dl_state_dict.bin"} if stateful else set())

    # Each attempt dies past the 3 steps after its last commit that the next one checks.
    cut = Run(tmp_path / "cut", job_spec())
    attempt(cut, stateful, until=10)
    sent, _, saw = attempt(cut, stateful, until=15)
    assert [m.step for m in sent if isinstance(m, Loaded)] == [6]
    assert (saw["start"].epoch, saw["start"].skip) == (1, 6)  # 4 + 2 steps: 3+3+3+1, 3+3
    assert not [m for m in sent if isinstance(m, Divergence)]
    sent, got, saw = attempt(cut, stateful)
    assert (saw["start"].step, saw["start"].epoch, saw["start"].skip) == (12, 3, 0)
    assert not [m for m in sent if isinstance(m, Divergence)]
    assert got == want


def test_mistakes_are_refused_with_what_to_do(tmp_path: Path, accelerate_state: None) -> None:
    run = Run(tmp_path, job_spec())
    ctx = RunContext(
        Task(run_id=RUN, spec=run.job), 1, run.store_url, tmp_path / "spool", lambda m: None
    )
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        make_accelerator(ctx, project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    accelerator = make_accelerator(
        ctx, gradient_accumulation_steps=2, dataloader_config=DataLoaderConfiguration()
    )
    model = torch.nn.Linear(2, 1)
    loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2, shuffle=True)
    loop = AcceleratedRun(ctx, accelerator, model)
    with pytest.raises(RuntimeError, match=r"prepare\(...\) before resume"):
        loop.resume()
    model, loader = accelerator.prepare(model, loader)
    with pytest.raises(RuntimeError, match="resume"):
        loop.step_ended()
    loop.resume()
    with pytest.raises(ValueError, match="use_seedable_sampler"):
        next(loop.batches(loader))
    with accelerator.accumulate(model):  # the first of two micro-batches
        pass
    with pytest.raises(RuntimeError, match="sync_gradients"):
        loop.step_ended()
    ctx.close()


# -- end to end ------------------------------------------------------------------------

TOTAL = 60
PACE = 0.05
"""Seconds between steps of a run a test interrupts: enough for a kill to land mid-run."""

_spares = itertools.count(1)


def lm(key: str, *, ranks: int = 1, pace: float = PACE, **config: Any) -> JobSpec:
    """The example job, small: 60 steps of 8 windows of 32 characters (an epoch is 94
    batches at one rank, 47 at two), a checkpoint every 10 steps."""
    return job(
        name="accelerate-lm",
        entry_point="examples.accelerate_lm:train",
        total_steps=TOTAL,
        ranks=ranks,
        seed=5,
        checkpoint={"every_steps": 10},
        config={"window": 32, "stride": 8, "batch": 8, "warmup": 5, "steps_sleep": pace} | config,
        idempotency_key=key,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with named_trainers(tmp_path_factory.mktemp("accelerate"), ("t1", "t2", "t3")) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def references(stack: Stack) -> dict[int, RunRecord]:
    """The uninterrupted runs, at one rank and at two, side by side (three trainers): their
    records, by ranks. The pace changes no arithmetic."""
    nc = await stack.client()
    runs = {n: await submit(nc, lm(f"reference-{n}", ranks=n, pace=0.0)) for n in (1, 2)}
    records = await asyncio.gather(*(finished(nc, r, timeout=180) for r in runs.values()))
    for record in records:
        assert record.state is RunState.COMPLETED, record.reason
        assert record.digest
    return dict(zip(runs, records, strict=True))


async def spare(stack: Stack) -> None:
    """Another trainer, for the one a test killed."""
    await stack.add_trainer(f"spare-{next(_spares)}")


def no_divergence(log: EventLog) -> None:
    assert not log.of(Diverged), [(e.step, e.metric, e.expected, e.got) for e in log.of(Diverged)]


def checked(log: EventLog, first: str, resumed: int) -> None:
    """No divergence, and not for want of a check: the first attempt (led by `first`) ran
    past the steps after the checkpoint the run resumed from whose metrics are its witness,
    so the resumed attempt compared its own with them."""
    reached = max(e.step for e in log.of(Progress) if e.worker == first)
    assert reached >= resumed + witness.STEPS, (reached, resumed)
    no_divergence(log)


@pytest.mark.slow
@end_to_end
async def test_the_loss_reaches_progress_events_and_the_record(
    stack: Stack, references: dict[int, RunRecord]
) -> None:
    nc = await stack.client()
    for record in references.values():
        assert record.step == TOTAL
        assert 0 < record.metrics["loss"] < 10, record.metrics
        events = await history(nc, record.run_id)
        losses = [e.metrics["loss"] for e in events if isinstance(e, Progress)]
        assert losses and all(0 < loss < 10 for loss in losses)
        assert {"lr", "epoch"} <= set(record.metrics)
        assert not [e for e in events if isinstance(e, Diverged)]
    # One rank and two see the same data in another order and split: not the same weights.
    assert references[1].digest != references[2].digest


@pytest.mark.slow
@end_to_end
async def test_sigkill_resumes_on_another_trainer_bitwise_equal(
    stack: Stack, references: dict[int, RunRecord]
) -> None:
    nc = await stack.client()
    run_id = await submit(nc, lm("kill"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the start")
    assert isinstance(first, Started)
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 20, 90, "a commit at step 20"
    )
    # Past the steps after it whose losses the self-check of the resume compares.
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 24, 60, "step 24")
    family = children_of(stack.pid(first.worker))
    stack.signal(first.worker, signal.SIGKILL)
    await all_dead(family, "the killed trainer's training process")
    await spare(stack)

    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == references[1].digest, "weights differ from the uninterrupted run"
    second = log.of(Started)[1]
    assert second.worker != first.worker and second.token > first.token
    committed = {e.step for e in log.of(CheckpointCommitted) if e.token == first.token}
    resumed = log.of(Restored)[1]
    assert resumed.step >= 20 and resumed.step in committed
    assert 0 < record.metrics["loss"] < 10
    checked(log, first.worker, resumed.step)
    log.close()


@pytest.mark.slow
@end_to_end
async def test_sigterm_saves_within_the_grace_and_loses_no_step(
    stack: Stack, references: dict[int, RunRecord]
) -> None:
    nc = await stack.client()
    run_id = await submit(nc, lm("term"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the start")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 15, 90, "step 15")
    stack.signal(first.worker, signal.SIGTERM)

    pre = await log.wait_for(lambda e: isinstance(e, Preempted), 60, "the preemption")
    assert isinstance(pre, Preempted) and pre.worker == first.worker
    # Saved where it stopped, off the policy's steps, and committed under its lease.
    assert any(e.step == pre.step and e.token == first.token for e in log.of(CheckpointCommitted))
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.worker != first.worker, 90, "the resume"
    )
    assert isinstance(resumed, Restored) and resumed.step == pre.step  # zero lost steps
    await spare(stack)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == references[1].digest
    no_divergence(log)
    log.close()


@pytest.mark.slow
@end_to_end
async def test_two_ranks_survive_a_lost_rank_bitwise_equal(
    stack: Stack, references: dict[int, RunRecord]
) -> None:
    nc = await stack.client()
    run_id = await submit(nc, lm("kill-rank", ranks=2))
    log = EventLog(nc, run_id)
    formed = await log.wait_for(lambda e: isinstance(e, GroupFormed), 90, "the group")
    assert isinstance(formed, GroupFormed) and len(set(formed.members)) == 2
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 10, 90, "a commit at step 10"
    )
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 14, 60, "step 14")
    leader = attempt_processes(stack.pid(formed.members[0]))
    stack.signal(formed.members[1], signal.SIGKILL)  # rank 1's trainer
    lost = await log.wait_for(lambda e: isinstance(e, RankLost), 60, "the rank's loss")
    assert isinstance(lost, RankLost) and lost.rank == 1 and lost.lost == formed.members[1]
    await all_dead(leader, "rank 0's process of the broken group")
    again = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > formed.epoch, 90, "the group again"
    )
    assert isinstance(again, GroupFormed) and formed.members[1] not in again.members
    await spare(stack)  # for the next test; the re-formed group has the other two

    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == references[2].digest, "weights differ from the uninterrupted run"
    committed = {e.step for e in log.of(CheckpointCommitted)}
    resumed = [e for e in log.of(Restored) if e.at >= again.at]
    assert resumed and all(r.step >= 10 and r.step in committed for r in resumed)
    assert record.retries == 0
    checked(log, formed.members[0], resumed[0].step)
    log.close()
