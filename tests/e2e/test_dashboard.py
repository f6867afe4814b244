"""The dashboard in a real headless browser (Debian's Chromium) against a real stack, logged
in as the `dashboard` role: a run seen live through a kill and its resume, a dead letter
replayed from the page, and a server that starts only with credentials that can read the
runs and only on loopback unless told."""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import expect

from shared.bus import names
from shared.bus.answer import post_letter
from shared.contracts import encode, run_id_for
from shared.contracts.events import Accepted, CheckpointCommitted, Started
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.dashboard import Rig, UiProcess, listening_addresses, rigged

pytestmark = [pytest.mark.asyncio(loop_scope="module")]
WAIT_MS = 60_000


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    """One stack (two trainers, TTL 3), one `baton ui` (as the dashboard) and one browser
    for the module."""
    async with rigged(tmp_path_factory.mktemp("dashboard"), trainers=2, lease_ttl=3) as rig:
        yield rig


async def test_a_run_appears_moves_and_shows_its_kill_and_resume_without_a_reload(
    rig: Rig,
) -> None:
    nc = await rig.stack.client()
    page = await rig.browser.new_page()
    await page.goto(f"{rig.ui.url}#/runs")
    await page.evaluate("window.sameDocument = true")  # gone if the page ever reloads
    await expect(page.locator("#link")).to_have_text("live", timeout=WAIT_MS)

    spec = job(
        entry_point="tests.support.workloads:paced", total_steps=240,
        checkpoint={"every_steps": 20}, config={"pace": 0.03},
    )  # fmt: skip
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    row = page.locator(f'tr[data-run="{run_id}"]')
    await expect(row).to_be_visible(timeout=WAIT_MS)  # it appeared: pushed, not reloaded
    await expect(row.locator(".state-cell")).to_have_text("RUNNING", timeout=WAIT_MS)
    before = await row.locator(".step-cell").inner_text()
    await expect(row.locator(".step-cell")).not_to_have_text(before, timeout=WAIT_MS)

    await row.locator("a").click()  # to the run's page: a change of hash, not a load
    await expect(page.locator("#run-state .state")).to_have_text("RUNNING", timeout=WAIT_MS)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the first attempt")
    assert isinstance(first, Started)
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 60, 60, "a commit at 60"
    )
    rig.stack.signal(first.worker, signal.SIGKILL)  # not restarted: a host gone

    attempts = page.locator("#attempts tr[data-attempt]")
    await expect(attempts).to_have_count(2, timeout=WAIT_MS)
    await expect(page.locator('#attempts tr[data-attempt="1"]')).to_contain_text("died")
    await expect(page.locator('#marks tr[data-kind="handed_over"]')).to_have_count(1)
    await expect(page.locator('#marks tr[data-kind="restored"]')).to_have_count(2)
    await expect(page.locator("#timeline rect[data-attempt]")).to_have_count(2)
    assert await page.locator("#timeline rect[data-commit]").count() >= 3  # 20, 40, 60
    await expect(page.locator("#loss-legend .series")).to_have_count(2)
    await expect(page.locator("#run-state .state")).to_have_text("COMPLETED", timeout=120_000)
    assert await page.evaluate("window.batonLoss.series.length") == 3  # x and two attempts
    # Its goodput, once it is over: the share and where the rest went (steps redone).
    await expect(page.locator("#goodput-share")).to_contain_text("%", timeout=WAIT_MS)
    await expect(page.locator('#goodput [data-category="wasted"]')).to_have_count(1)
    await page.locator("header a[data-view=runs]").click()
    await expect(row.locator(".goodput-cell")).to_contain_text("%", timeout=WAIT_MS)
    assert await page.evaluate("window.sameDocument") is True, "the page was reloaded"
    record = await finished(nc, run_id, 60)
    assert record.attempts == 2
    log.close()
    await page.close()  # the other trainer is left for the module's next tests


async def test_a_dead_letter_replayed_from_the_page_is_dispatched_once(rig: Rig) -> None:
    nc = await rig.stack.client()
    js = nc.jetstream()
    spec = job(total_steps=5, idempotency_key="from-the-dead-letters")
    run_id = run_id_for("from-the-dead-letters")
    # A submission the dispatcher gave up on (its deliveries used up while it was down).
    await post_letter(
        js, names.SUBMIT_STREAM, source="dispatcher", subject=names.submit_subject("default"),
        reason="max deliveries reached (10)", payload=encode(spec),
        headers={"Nats-Msg-Id": spec.idempotency_key}, stream_seq=424242, delivered=10,
    )  # fmt: skip
    page = await rig.browser.new_page()
    await page.goto(f"{rig.ui.url}#/dlq")
    letter = page.locator("tr[data-seq]", has_text="max deliveries reached (10)")
    await expect(letter).to_have_count(1, timeout=WAIT_MS)
    button = letter.locator("button.replay")
    await button.click()
    await expect(letter).to_contain_text("replayed to baton.submit.default", timeout=WAIT_MS)
    await expect(button).to_be_disabled()
    # A second replay of the same letter — another tab, a script — finds it gone.
    seq = await letter.get_attribute("data-seq")
    token = await page.get_attribute('meta[name="baton-token"]', "content")
    origin = rig.ui.url.rstrip("/")  # what the page's own requests carry
    replay = f"{rig.ui.url}api/dlq/{seq}/replay"
    again = await page.request.post(
        replay, headers={"X-Baton-Token": token or "", "Origin": origin}
    )
    assert again.status == 404
    assert (await page.request.post(replay, headers={"Origin": origin})).status == 403  # no token
    assert (await page.request.post(replay, headers={"X-Baton-Token": token or ""})).status == 403
    record = await finished(nc, run_id, 90)
    assert record.dispatch == 1
    accepted = [e for e in await history(nc, run_id) if isinstance(e, Accepted)]
    assert [a.duplicate for a in accepted] == [False], "dispatched once"
    await page.close()


async def test_a_trainer_heard_just_now_reads_so_in_a_browser_whose_clock_is_5_minutes_off(
    rig: Rig,
) -> None:
    """The page's ages are the hub's (its stamp and its now), never the browser's clock: a
    browser 5 minutes ahead shows the live trainer heard seconds ago, not 5 minutes. The
    browser's clock is skewed by Playwright's clock (`Date`), not libfaketime, which
    Chromium's sandboxed processes do not reliably take."""
    page = await rig.browser.new_page()
    await page.clock.set_system_time(time.time() + 300)
    await page.goto(f"{rig.ui.url}#/workers")
    assert await page.evaluate("Date.now() / 1000") - time.time() > 250, "the skew took"
    beats = page.locator("#workers-body tr[data-worker] .beat")
    await expect(beats.first).to_have_text(re.compile(r" ago$"), timeout=WAIT_MS)
    shown = await beats.all_inner_texts()
    # The trainer killed earlier in this module may still be listed until its entry expires.
    fresh = [int(t.removesuffix("s ago")) for t in shown if re.fullmatch(r"\d+s ago", t)]
    assert fresh and min(fresh) < 60, shown
    await page.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_it_starts_only_with_credentials_that_read_the_runs_and_on_loopback(
    rig: Rig, tmp_path: Path
) -> None:
    # The module's dashboard was given no address: it listens on loopback alone.
    port = int(rig.ui.url.rstrip("/").rpartition(":")[2])
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1

    port = free_port()
    bare = UiProcess(
        "ui", "--port", str(port), "--server", rig.stack.nats.url, cwd=tmp_path
    )  # no credentials given, none in ./.baton
    try:
        assert await bare.start() == ""
        assert await bare.exit_code() == 1
    finally:
        await bare.stop()
    assert "refused the credentials" in bare.output, bare.output
    assert listening_addresses(port) == set()

    rig.stack.audit.allow_server(
        r'"\$G/user:submitter" - Publish Violation - Subject "\$JS\.API\.CONSUMER\.CREATE\.KV_',
        "a dashboard started as a submitter, to show it is refused the runs bucket",
    )
    submitter = UiProcess(
        "--auth-file", str(rig.stack.root / "auth" / "submitter.env"), "ui", "--port",
        str(port), "--server", rig.stack.nats.url, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert await submitter.start() == ""
        assert await submitter.exit_code() == 1
    finally:
        await submitter.stop()
    assert "operator's credentials" in submitter.output, submitter.output
    assert listening_addresses(port) == set()


async def test_the_dashboard_role_was_refused_nothing_the_page_asked_for(rig: Rig) -> None:
    """Run last: whatever this module's pages made the dashboard ask of NATS, the hub's
    server refused none of it (a refusal reads, to the client, as a mere timeout)."""
    assert "NATS user dashboard" in rig.ui.output, rig.ui.output
    refused = [
        line
        for log in sorted(rig.stack.root.rglob("nats-server.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "Violation" in line and "dashboard" in line
    ]
    assert refused == []
