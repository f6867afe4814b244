"""Scripts written the way users write them resume bitwise: SIGKILL mid-run, compare weights.

`examples/regression.py` makes its batches from the step alone; real scripts shuffle a
dataset epoch after epoch, keep their position in a cursor or a stateful loader, use worker
processes, schedulers and dropout. Each test runs one of them twice at once on a real stack
— an uninterrupted reference and a victim whose trainer is SIGKILLed at planned points —
and requires the victim to finish with the reference's weights digest, having really
resumed (a newer lease, a restored step past 0) from where the plan says, and without the
run ever reporting that a resumed step diverged.

Each plan is checked, not assumed: a kill that lands elsewhere (the last commit before it,
or the step it reached, outside what the case is about) fails the test instead of passing
it vacuously. Kill points leave ~10 steps of slack for the latency between a step and the
`Progress` event that tells the test it happened; `pace` slows the jobs down enough.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.cli.watch import describe
from baton.client.calls import cancel, divergences, record
from examples import charlm, cnn
from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    CheckpointCommitted,
    Completed,
    Diverged,
    Event,
    Progress,
    Restored,
    Started,
)
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack, alive, children_of, eventually

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def three(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """One trainer for the reference, one for the victim, one idle to take the victim over.
    Shared by the module's tests: starting a stack costs each trainer a zygote training
    process that imports torch, ~6 s of CPU apiece. Every test leaves three idle trainers."""
    async with Stack(
        tmp_path_factory.mktemp("user-scripts") / "stack", trainers=3, lease_ttl=3
    ) as s:
        yield s


@dataclass(frozen=True)
class Resume:
    """One kill and the attempt after it."""

    reached: int
    """The killed attempt's last reported step: the kill landed there or a little later."""
    restored: int
    """The step the next attempt restored: the newest commit before the kill."""

    def epochs(self, per_epoch: int) -> str:
        def at(step: int) -> str:
            return f"{step} (epoch {step // per_epoch} + {step % per_epoch})"

        return f"killed after {at(self.reached)}, restored {at(self.restored)}"


Check = Callable[[Resume], bool]


async def kill_and_compare(
    stack: Stack, name: str, spec: Callable[..., JobSpec], plan: list[tuple[int, Check, str]]
) -> list[Resume]:
    """Run the reference and the victim at once; SIGKILL the victim's trainer once each
    attempt has reported step `at`, for each `(at, check, what)` of `plan`; require that
    `check` holds for where the kill landed (`what` says what it should be), and that the
    victim ends COMPLETED with the reference's digest. Returns the resumes."""
    nc = await stack.client()
    reference = await submit(nc, spec(idempotency_key=f"{name}-reference"))
    victim = await submit(nc, spec(idempotency_key=f"{name}-victim"))
    log = EventLog(nc, victim)
    resumes: list[Resume] = []
    missing = 0
    try:
        token = 0
        for i, (at, check, what) in enumerate(plan):
            attempt = await _next_attempt(log, token)
            token = attempt.token
            await log.wait_for(
                _progress(attempt.worker, at), 60, f"attempt {i + 1} to reach step {at}"
            )
            pid = stack.pid(attempt.worker)
            family = [pid, *children_of(pid)]  # its training process and data workers
            os.kill(pid, signal.SIGKILL)
            missing += 1
            await _all_dead(family, f"{attempt.worker} and its training process")

            heir = await _next_attempt(log, token)
            # Replaced only now, so that the run goes to a trainer whose zygote training
            # process is warm, not to one still importing torch.
            await stack.add_trainer(f"{name}-{i + 1}")
            missing -= 1
            restored = await log.wait_for(
                _restored_by(heir.worker), 60, f"attempt {i + 2} to restore"
            )
            assert isinstance(restored, Restored)
            reached = max(
                (e.step for e in log.of(Progress) if e.worker == attempt.worker), default=0
            )
            resume = Resume(reached=reached, restored=restored.step)
            resumes.append(resume)
            assert heir.worker != attempt.worker and heir.token > attempt.token
            assert resume.restored > 0, f"kill {i + 1}: nothing was restored ({resume})"
            assert check(resume), f"kill {i + 1} landed elsewhere: wanted {what}; {resume}"

        want = await finished(nc, reference, timeout=120)
        got = await finished(nc, victim, timeout=120)
        assert want.state is RunState.COMPLETED and want.digest, want
        assert got.state is RunState.COMPLETED, f"the victim ended {got.state}: {got.reason}"
        events = await history(nc, victim)
        diverged = [e for e in events if isinstance(e, Diverged)]
        started = [e for e in events if isinstance(e, Started)]
        assert len(started) == len(plan) + 1, f"attempts: {started}"
        assert got.digest == want.digest, (
            f"{name}: weights differ from the uninterrupted run's after {resumes}"
            f" (diverged: {diverged})"
        )
        assert not diverged, f"{name}: exact, yet the run reported divergence: {diverged}"
        assert not [e for e in await history(nc, reference) if isinstance(e, Diverged)]
        return resumes
    finally:
        log.close()
        await _timeline(nc, victim, reference)  # shown by pytest when the test fails
        # Whatever happened, leave the stack as the next test expects it: three trainers,
        # none busy.
        for i in range(missing):
            await stack.add_trainer(f"{name}-replacement-{i}")
        for run_id in (reference, victim):
            with contextlib.suppress(Exception):
                if not (await record(nc, run_id)).state.terminal:
                    await cancel(nc, run_id, "the test is over")
                    await finished(nc, run_id, timeout=30)


async def _timeline(nc: Client, victim: str, reference: str) -> None:
    events = await history(nc, victim)
    t0 = events[0].at if events else 0.0
    for e in events:
        if not isinstance(e, Progress) or e.step % 10 == 0:
            step = getattr(e, "step", "")
            print(f"{e.at - t0:7.2f}s {type(e).__name__} {step} {getattr(e, 'worker', '')}")
    done = [e for e in await history(nc, reference) if isinstance(e, Completed)]
    print(f"reference: {f'completed at {done[0].at - t0:.2f}s' if done else 'not completed'}")


def _progress(worker: str, at: int) -> Callable[[Event], bool]:
    return lambda e: isinstance(e, Progress) and e.worker == worker and e.step >= at


def _restored_by(worker: str) -> Callable[[Event], bool]:
    return lambda e: isinstance(e, Restored) and e.worker == worker


async def _next_attempt(log: EventLog, after_token: int) -> Started:
    started = await log.wait_for(
        lambda e: isinstance(e, Started) and e.token > after_token,
        60,
        f"an attempt with a lease newer than token {after_token}",
    )
    assert isinstance(started, Started)
    return started


async def _all_dead(pids: list[int], what: str) -> None:
    async def gone() -> bool:
        return not any(alive(p) for p in pids)

    # A data loader's workers notice their parent is gone within ~5s (torch's watchdog).
    await eventually(gone, 15, what)


def _mid_epoch(per_epoch: int, epoch: int) -> Check:
    """Restored inside epoch `epoch`, and the killed attempt had not left that epoch."""
    return lambda r: (
        r.restored // per_epoch == epoch
        and r.restored % per_epoch != 0
        and r.reached < (epoch + 1) * per_epoch
    )


def charlm_job(data: str, total: int, every: int, **config: Any) -> Callable[..., JobSpec]:
    def spec(**over: Any) -> JobSpec:
        return job(
            name=f"charlm-{data}",
            entry_point="examples.charlm:train",
            total_steps=total,
            seed=17,
            checkpoint={"every_steps": every},
            config={"data": data, "pace": 0.03, **config},
            **over,
        )

    return spec


CHARLM_EPOCH = charlm.batches_per_epoch({})  # 602 windows of 32 characters, 16 a batch: 38


async def test_charlm_with_a_cursor_survives_three_kills(three: Stack) -> None:
    """A plain DataLoader, its position in `ctx.cursor`: killed mid-epoch, just past an
    epoch boundary (it restores exactly at the boundary, the cursor at the epoch's end), and
    mid-epoch again, all in one run."""
    per = CHARLM_EPOCH
    every = per // 2  # every other commit lands on an epoch boundary
    assert per % 2 == 0 and every >= 15, f"the plan needs an even epoch of 30+ batches: {per}"
    at_boundary: Check = lambda r: (  # noqa: E731
        r.restored == 2 * per and 2 * per < r.reached < 2 * per + every
    )
    plan = [
        (every + 3, _mid_epoch(per, 0), f"restored at {every}, killed before {per}"),
        (2 * per + 1, at_boundary, f"killed just past step {2 * per}, restored there"),
        (5 * every + 5, _mid_epoch(per, 2), f"restored at {5 * every}, killed before {3 * per}"),
    ]
    resumes = await kill_and_compare(
        three, "cursor", charlm_job("cursor", 3 * per + 6, every), plan
    )
    print("charlm/cursor:", "; ".join(r.epochs(per) for r in resumes))


async def test_charlm_with_batons_loader_and_workers_survives_a_mid_epoch_kill(
    three: Stack,
) -> None:
    """`ctx.data_loader` with two worker processes, killed in the middle of the second
    epoch (so that the epoch count is restored too, and checked: the job reports it); the
    run then goes on into the third."""
    per, every = CHARLM_EPOCH, 12
    at = (per // every + 1) * every  # 48: the first commit well inside epoch 1
    assert per < at and at + every < 2 * per
    plan = [(at + 2, _mid_epoch(per, 1), f"restored at {at}, killed before {at + every}")]
    resumes = await kill_and_compare(
        three, "baton", charlm_job("baton", 2 * per + 10, every, num_workers=2), plan
    )
    print("charlm/baton:", "; ".join(r.epochs(per) for r in resumes))


async def test_charlm_with_a_stateful_dataloader_survives_a_kill_across_an_epoch_end(
    three: Stack,
) -> None:
    """torchdata's StatefulDataLoader with a seeded generator, registered with `restore()`
    and nothing else: the last commit before the kill is in epoch 1, the kill in epoch 2, so
    the resumed attempt must shuffle epoch 2 as the first attempt did."""
    per, every = CHARLM_EPOCH, 25
    last_commit = (2 * per // every) * every  # 75: the newest commit of epoch 1
    assert per < last_commit < 2 * per and last_commit + every - 2 * per >= 10
    across: Check = lambda r: (  # noqa: E731
        r.restored == last_commit and 2 * per <= r.reached < last_commit + every
    )
    plan = [(2 * per + 1, across, f"restored at {last_commit}, killed in epoch 2")]
    resumes = await kill_and_compare(three, "torchdata", charlm_job("torchdata", 100, every), plan)
    print("charlm/torchdata:", "; ".join(r.epochs(per) for r in resumes))


async def test_cnn_survives_a_kill(three: Stack) -> None:
    """The CNN example: BatchNorm statistics, SGD momentum, a one-cycle schedule, dropout,
    and images made by `ctx.data_loader`'s workers; killed in the middle of epoch 1."""
    config: dict[str, Any] = {"samples": 768, "batch": 32, "width": 8, "num_workers": 2}
    per, every = len(cnn.train_set(config, 0)) // config["batch"], 12  # drop_last: 24
    at = per + every  # 36
    assert per % every == 0 and at + every <= 2 * per, (per, every)

    def spec(**over: Any) -> JobSpec:
        return job(
            name="cnn",
            entry_point="examples.cnn:train",
            total_steps=2 * per + every,
            seed=23,
            checkpoint={"every_steps": every},
            config={**config, "pace": 0.02},
            **over,
        )

    plan = [(at + 2, _mid_epoch(per, 1), f"restored at {at}, killed before {at + every}")]
    resumes = await kill_and_compare(three, "cnn", spec, plan)
    print("cnn:", "; ".join(r.epochs(per) for r in resumes))


async def test_a_resume_that_is_not_exact_is_flagged(three: Stack) -> None:
    """A run checks itself: a job whose dropout masks come from a generator it never
    registers resumes inexactly, and says so with one `diverged` event at the first step
    after the resume, naming the checkpoint, the metric and both values (what `baton
    status` and `baton logs` show). The exact jobs above assert the converse: no event."""
    nc = await three.client()
    spec = job(
        entry_point="tests.support.workloads:unregistered_generator", total_steps=80,
        checkpoint={"every_steps": 10}, config={"pace": 0.03}, seed=5,
        idempotency_key="not-exact",
    )  # fmt: skip
    loose = await submit(nc, spec)
    log = EventLog(nc, loose)
    replaced = True
    try:
        first = await _next_attempt(log, 0)
        done = await log.wait_for(lambda e: isinstance(e, CheckpointCommitted), 30, "a commit")
        assert isinstance(done, CheckpointCommitted)
        await log.wait_for(_progress(first.worker, done.step + 5), 30, "steps past the commit")
        pid = three.pid(first.worker)
        family = [pid, *children_of(pid)]
        os.kill(pid, signal.SIGKILL)
        replaced = False
        await _all_dead(family, f"{first.worker} and its training process")
        await _next_attempt(log, first.token)
        await three.add_trainer("not-exact-1")
        replaced = True

        flagged = await log.wait_for(lambda e: isinstance(e, Diverged), 60, "a diverged event")
        assert isinstance(flagged, Diverged)
        resumed = log.of(Restored)[-1]
        assert resumed.step > 0 and flagged.checkpoint == resumed.step, (resumed, flagged)
        assert resumed.step < flagged.step <= resumed.step + 3, "not within the first steps"
        assert flagged.metric == "loss" and float(flagged.expected) != float(flagged.got)
        record = await finished(nc, loose)
        assert record.state is RunState.COMPLETED, "a divergence is reported, not stopped"
        assert len(log.of(Diverged)) == 1, "one report per resume"
        assert await divergences(nc, loose) == [flagged]
        line = describe(flagged)
        assert line is not None and f"step {flagged.step}" in line and flagged.got in line, line
    finally:
        log.close()
        if not replaced:
            await three.add_trainer("not-exact-replacement")
