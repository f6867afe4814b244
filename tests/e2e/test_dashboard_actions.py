"""Operators' controls on the dashboard, in a real headless browser (Debian's Chromium)
against a real stack under `baton up`'s authorization, the dashboard logged in as its role:
a run checkpointed now, paused and resumed from its page; rolled back from a checkpoint row
and forked with an override; a trainer drained and undrained from the workers' page; and
what an operator watches on a run's page — its guard's rollback, the data left out, what a
failure now would lose, its interruptions by cause. Each action, tried first without the
page's token, fails on the page saying so and changes nothing: the stream it would have
written to has not moved.

Every wait here is bounded only against a hang: nothing passes or fails on how fast it went.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from playwright.async_api import Page, Route, expect

from shared.bus import names
from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    CheckpointCommitted,
    Guarded,
    Paused,
    Progress,
    Restored,
    Resumed,
    RolledBack,
)
from shared.state.drains import Drains
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.dashboard import Rig, rigged

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow, pytest.mark.operations]
WAIT_MS = 120_000
"""Only against a hang: a loaded machine may take long, never this long."""
HANG_S = 120.0
ACTIONS = re.compile(
    r"/api/(runs/[^/]+/(pause|resume|checkpoint|checkpoints/\d+/(rollback|fork))"
    r"|workers/[^/]+/(drain|undrain))$"
)
"""The action routes' URLs (and no read's)."""
NO_TOKEN = "this action needs the page's token"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    """One stack (two trainers, heartbeats every half second, so a drain shows at once),
    one `baton ui` as the dashboard role, one browser, for the module."""
    async with rigged(
        tmp_path_factory.mktemp("dashboard-actions"),
        trainers=2,
        lease_ttl=3,
        env={"BATON_HEARTBEAT": "0.5"},
    ) as rig:
        yield rig


def guarded(entry: str, **over: Any) -> JobSpec:
    return job(entry_point=f"tests.support.guarded:{entry}", **over)


async def last_seq(nc: Client, stream: str) -> int:
    return (await nc.jetstream().stream_info(stream)).state.last_seq


@contextlib.asynccontextmanager
async def tokenless(page: Page) -> AsyncIterator[None]:
    """The page's actions sent without its token (the header taken off on the way)."""

    async def strip(route: Route) -> None:
        headers = {k: v for k, v in route.request.headers.items() if k.lower() != "x-baton-token"}
        await route.continue_(headers=headers)

    await page.route(ACTIONS, strip)
    try:
        yield
    finally:
        await page.unroute(ACTIONS, strip)


async def refused_on_the_page(page: Page, what: str) -> None:
    """The notice says `what` failed for want of the token, offers a reload; dismissed."""
    notice = page.locator("#notice-text")
    await expect(notice).to_contain_text(f"{what} failed: {NO_TOKEN}", timeout=WAIT_MS)
    await expect(page.locator("#notice-reload")).to_be_visible()
    await page.locator("#notice .dismiss").click()
    await expect(page.locator("#notice")).to_be_hidden()


async def run_page(rig: Rig, run_id: str) -> Page:
    page = await rig.browser.new_page()
    await page.goto(f"{rig.ui.url}#/run/{run_id}")
    return page


async def test_checkpoint_now_pause_and_resume_from_the_run_page(rig: Rig) -> None:
    nc = await rig.stack.client()
    run_id = await submit(
        nc,
        guarded("slow", total_steps=300, config={"step_s": 0.05}, checkpoint={"every_steps": 1000}),
    )  # fmt: skip
    log = EventLog(nc, run_id)
    page = await run_page(rig, run_id)
    state = page.locator("#run-state .state")
    checkpoint, pause, resume = (
        page.locator(f"#act-{a}") for a in ("checkpoint", "pause", "resume")
    )
    # Its training process has stepped: a checkpoint asked before it started is not taken.
    await log.wait_for(lambda e: isinstance(e, Progress), HANG_S, "the run to step")
    await expect(state).to_have_text("RUNNING", timeout=WAIT_MS)
    await expect(checkpoint).to_be_visible(timeout=WAIT_MS)
    await expect(resume).to_be_hidden()

    steered = await last_seq(nc, names.CANCEL_STREAM)
    async with tokenless(page):
        await checkpoint.click()
        await refused_on_the_page(page, f"asking for a checkpoint of {run_id}")
        await expect(page.locator("#act-status.error")).to_contain_text(NO_TOKEN)
        await expect(checkpoint).to_be_enabled()
        await pause.click()
        await refused_on_the_page(page, f"pausing {run_id}")
    assert await last_seq(nc, names.CANCEL_STREAM) == steered, "a refused action published"
    assert not log.of(CheckpointCommitted) and not log.of(Paused)

    # Checkpoint now: the button stays disabled while its request is in flight.
    release = asyncio.Event()

    async def held(route: Route) -> None:
        await release.wait()
        await route.continue_()

    await page.route(ACTIONS, held)
    await checkpoint.click()
    await expect(checkpoint).to_be_disabled()
    release.set()
    await expect(page.locator("#act-status")).to_contain_text("checkpoint asked", timeout=WAIT_MS)
    await page.unroute(ACTIONS, held)
    await expect(checkpoint).to_be_enabled()
    committed = await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted), HANG_S, "the checkpoint asked for"
    )
    assert isinstance(committed, CheckpointCommitted)
    assert 0 < committed.step < 300, committed  # off its cadence (every 1000), not its last
    row = page.locator(f'#checkpoints tr[data-step="{committed.step}"]')
    await expect(row).to_have_attribute("data-status", "chain", timeout=WAIT_MS)

    await page.locator("#act-reason").fill("maintenance window")
    await pause.click()
    await expect(state).to_have_text("PAUSED", timeout=WAIT_MS)
    hold = page.locator("#run-hold")
    await expect(hold).to_contain_text("paused — maintenance window", timeout=WAIT_MS)
    await expect(hold).to_have_class(re.compile(r"\bPAUSED\b"))
    await expect(resume).to_be_visible()
    await expect(pause).to_be_hidden()
    await expect(checkpoint).to_be_hidden()
    await log.wait_for(lambda e: isinstance(e, Paused), HANG_S, "the paused event")
    assert [e.reason for e in log.of(Paused)] == ["maintenance window"]

    steered = await last_seq(nc, names.CANCEL_STREAM)
    async with tokenless(page):
        await resume.click()
        await refused_on_the_page(page, f"resuming {run_id}")
    assert await last_seq(nc, names.CANCEL_STREAM) == steered, "a refused resume published"
    await expect(state).to_have_text("PAUSED")

    await page.locator("#act-reason").fill("")
    await resume.click()
    await expect(state).to_have_text("COMPLETED", timeout=WAIT_MS)
    await expect(page.locator("#run-ending")).to_contain_text("completed")
    record = await finished(nc, run_id, HANG_S)
    assert record.state is RunState.COMPLETED, record
    assert [e.reason for e in log.of(Resumed)] == ["resumed from the dashboard"]
    log.close()
    await page.close()


async def test_a_rollback_from_a_checkpoint_row_then_a_fork_with_an_override(rig: Rig) -> None:
    nc = await rig.stack.client()
    run_id = await submit(
        nc,
        guarded("slow", total_steps=200, config={"step_s": 0.05}, checkpoint={"every_steps": 10}),
    )  # fmt: skip
    log = EventLog(nc, run_id)
    page = await run_page(rig, run_id)
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 30, HANG_S, "a commit at 30"
    )
    back = page.locator('#checkpoints tr[data-step="10"] button.rollback')
    await expect(back).to_be_visible(timeout=WAIT_MS)
    steered = await last_seq(nc, names.CANCEL_STREAM)
    async with tokenless(page):
        await back.click()
        await refused_on_the_page(page, f"rolling {run_id} back to step 10")
    assert await last_seq(nc, names.CANCEL_STREAM) == steered, "a refused rollback published"

    await back.click()
    done = await log.wait_for(lambda e: isinstance(e, RolledBack), HANG_S, "the rollback")
    assert isinstance(done, RolledBack) and done.to_step == 10, done
    assert done.reason == "rolled back from the dashboard", done
    await expect(page.locator("#run-state .state")).to_have_text("COMPLETED", timeout=WAIT_MS)
    lineage = page.locator("#run-lineage .rewind")
    await expect(lineage).to_contain_text(f"rolled back from step {done.from_step} to 10")
    record = await finished(nc, run_id, HANG_S)
    assert record.state is RunState.COMPLETED and record.rewinds[-1].to_step == 10, record
    # Over now: no rollback offered, a fork still is.
    await expect(page.locator("#checkpoints button.rollback")).to_have_count(0, timeout=WAIT_MS)

    # A fork from a checkpoint the rollback abandoned (retention may have taken 10 by now;
    # garbage collection leaves abandoned ones for an hour).
    assert done.abandoned, done
    base = min(done.abandoned)
    form = page.locator("#fork-form")
    await expect(form).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator('#checkpoints tr[data-status="abandoned"]').first).to_be_visible()
    await form.locator("#fork-step").select_option(str(base))
    await form.locator("#fork-overrides").fill("config.step_s=0.01\ntotal_steps=40")
    submitted = await last_seq(nc, names.SUBMIT_STREAM)
    async with tokenless(page):
        await form.locator("#fork-go").click()
        await refused_on_the_page(page, f"forking {run_id} from step {base}")
    assert await last_seq(nc, names.SUBMIT_STREAM) == submitted, "a refused fork submitted"
    await expect(form.locator("#fork-status.error")).to_contain_text(NO_TOKEN)

    await form.locator("#fork-go").click()
    link = form.locator("#fork-link")
    await expect(link).to_be_visible(timeout=WAIT_MS)
    forked = await link.inner_text()
    await link.click()  # to the fork's own page
    shown = page.locator("#run-lineage .forked-from")
    await expect(shown).to_contain_text(f"forked from {run_id} at step {base}", timeout=WAIT_MS)
    child = await finished(nc, forked, HANG_S)
    assert child.state is RunState.COMPLETED, child
    assert child.spec.fork is not None and (child.spec.fork.run_id, child.spec.fork.step) == (
        run_id, base,
    )  # fmt: skip
    assert child.spec.config["step_s"] == 0.01 and child.spec.total_steps == 40, child.spec
    restored = [e.step for e in await history(nc, forked) if isinstance(e, Restored)]
    assert restored == [base], restored  # from the parent's checkpoint, grafted
    await expect(shown).to_contain_text("grafted under token", timeout=WAIT_MS)
    log.close()
    await page.close()


async def test_a_guards_rollback_and_what_is_at_risk_show_on_the_run_page(rig: Rig) -> None:
    nc = await rig.stack.client()
    # Sample 100 is in batch 12 (in order, 32 batches an epoch): the loss turns infinite
    # there, and the guard rolls back to its last good checkpoint, leaving the batches since
    # out. Within one epoch, so the sample is drawn once.
    run_id = await submit(
        nc,
        guarded("poisoned", total_steps=30, config={"poison": 100, "shuffle": False,
                "step_s": 0.2}, checkpoint={"every_steps": 5}, guard={"action": "rollback"},
                limits={"max_retries": 0}),
    )  # fmt: skip
    page = await run_page(rig, run_id)
    # While it trains: the steps since its newest checkpoint and that checkpoint's age.
    risk = page.locator("#run-at-risk")
    await expect(risk).to_contain_text(re.compile(r"\d+ steps? · checkpoint [\d.]+s old"),
                                       timeout=WAIT_MS)  # fmt: skip
    await expect(page.locator("#run-state .state")).to_have_text("COMPLETED", timeout=WAIT_MS)
    await expect(risk).to_contain_text("—")  # nothing in training to lose
    events = await history(nc, run_id)
    guards = [e for e in events if isinstance(e, Guarded)]
    assert len(guards) == 1, guards
    g = guards[0]
    stop = page.locator('#run-guard .guarded[data-action="rollback"]')
    await expect(stop).to_contain_text(
        f"step {g.step}: loss = {g.value} ({g.rule}); rollback from step {g.good_step}",
        timeout=WAIT_MS,
    )
    left_out = g.step - g.good_step
    await expect(page.locator("#run-guard .skip")).to_have_text(
        f"left out {left_out} batch(es) after step {g.good_step}"
    )
    cause = page.locator('#run-interruptions tr[data-cause="divergence"]')
    await expect(cause).to_contain_text(re.compile(r"divergence\s*1\s*[\d.]+(s|min)"))
    await expect(page.locator('#marks tr[data-kind="guarded"]')).to_have_count(1)
    await page.close()


async def test_a_trainer_drained_and_undrained_from_the_workers_page(rig: Rig) -> None:
    nc = await rig.stack.client()
    drains = Drains(nc.jetstream())
    bucket = f"KV_{names.DRAINS_BUCKET}"
    page = await rig.browser.new_page()
    await page.goto(f"{rig.ui.url}#/workers")
    row = page.locator('#workers-body tr[data-worker="trainer-2"]')
    flag = row.locator(".drained-cell")
    await expect(row.locator("button.drain")).to_be_visible(timeout=WAIT_MS)
    await expect(flag).to_have_text("")

    written = await last_seq(nc, bucket)
    async with tokenless(page):
        await row.locator("button.drain").click()
        await refused_on_the_page(page, "draining trainer trainer-2")
    assert await last_seq(nc, bucket) == written and await drains.get("trainer-2") is None
    await expect(row.locator(".status.error")).to_contain_text(NO_TOKEN)

    await row.locator("button.drain").click()
    await expect(flag).to_have_text("drained", timeout=WAIT_MS)  # its own heartbeat says so
    drained = await drains.get("trainer-2")
    assert drained is not None and drained.reason == "drained from the dashboard", drained
    await expect(row.locator("button.undrain")).to_be_visible()

    written = await last_seq(nc, bucket)
    async with tokenless(page):
        await row.locator("button.undrain").click()
        await refused_on_the_page(page, "undraining trainer trainer-2")
    assert await last_seq(nc, bucket) == written and await drains.get("trainer-2") is not None

    await row.locator("button.undrain").click()
    await expect(flag).to_have_text("", timeout=WAIT_MS)
    assert await drains.get("trainer-2") is None
    await expect(row.locator("button.drain")).to_be_visible()
    await page.close()


async def test_the_dashboard_role_was_refused_nothing_the_page_did(rig: Rig) -> None:
    """Run last: whatever this module's pages made the dashboard do, the hub's server
    refused none of it (the stack's audit, when it stops, checks every role)."""
    refused = [
        line
        for log in sorted(rig.stack.root.rglob("nats-server.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "Violation" in line and "dashboard" in line
    ]
    assert refused == [], refused
    assert "nats: timeout" not in rig.ui.output
