"""The dashboard stays right under churn, in a real headless browser (Debian's Chromium)
against a real stack under `baton up`'s authorization, logged in as the `dashboard` role:
the runs list keeps its one order (newest first by creation) while 40 runs are submitted,
run and end, and its count and ages tick; a run's ending is in view on its page; dead
letters come a page at a time; the fleet's pages follow the hub without a reload; and an
action refused (the page's token is stale after the dashboard restarted) says so on the
page and changes nothing.

Every wait here is bounded only against a hang: nothing passes or fails on how fast it went.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from playwright.async_api import Page, expect

from shared.bus import names
from shared.bus.answer import post_letter
from shared.contracts import JobSpec, encode
from tests.e2e.jobs import finished, job, submit
from tests.support.dashboard import Rig, UiProcess, browser, get, request
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow, pytest.mark.operations]
WAIT_MS = 120_000
"""Only against a hang: a loaded machine may take long, never this long."""
HANG_S = 300.0
PAGE = 25
"""Runs on a page of the list (`PAGE` in the page's script)."""
CHURN = 40


def dashboard(stack: Stack, port: int) -> UiProcess:
    """`baton ui` as the dashboard role, on `port` (0: a free one)."""
    return UiProcess(
        "--auth-file", str(stack.root / "auth" / "dashboard.env"), "ui", "--port", str(port),
        "--server", stack.nats.url, "--store", stack.store_url, cwd=stack.root.parent,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    """One stack (two trainers), one `baton ui` (as the dashboard) and one browser."""
    s = Stack(tmp_path_factory.mktemp("dashboard-live") / "stack", trainers=2)
    uis: list[UiProcess] = []
    try:
        await s.start()
        uis.append(dashboard(s, 0))
        assert await uis[0].start(), f"baton ui did not start:\n{uis[0].output}"
        async with browser() as b:
            r = Rig(s, uis[0], b)
            yield r
            uis.append(r.ui)
    finally:
        for ui in uis:
            await ui.stop()
        await s.stop()


def short(**over: Any) -> JobSpec:
    """A run of a second or so with a checkpoint every 5 steps: each commit is a change of
    its record, pushed to the list."""
    return job(
        entry_point="tests.support.workloads:paced", total_steps=20,
        checkpoint={"every_steps": 5}, config={"pace": 0.01}, **over,
    )  # fmt: skip


async def opened(rig: Rig, view: str) -> Page:
    """A page of the dashboard on `view`, following the live stream; `window.sameDocument`
    is gone if it ever reloads."""
    page = await rig.browser.new_page()
    await page.goto(f"{rig.ui.url}#/{view}")
    await page.evaluate("window.sameDocument = true")
    await expect(page.locator("#link")).to_have_text("live", timeout=WAIT_MS)
    return page


async def not_reloaded(page: Page) -> None:
    assert await page.evaluate("window.sameDocument") is True, "the page was reloaded"


# Installed in the page: every change of the runs list is a sample, checked as it is made.
WATCH_THE_LIST = """() => {
  const body = document.querySelector("#runs-body");
  const count = document.querySelector(".pager span");
  const seen = window.listSeen = { samples: 0, inversions: [], counts: [] };
  const check = () => {
    seen.samples += 1;
    const rows = [...body.querySelectorAll("tr[data-run]")]
      .map((tr) => [Number(tr.dataset.created), tr.dataset.run]);
    for (let i = 1; i < rows.length; i++) {
      const [a, b] = [rows[i - 1], rows[i]];
      const inOrder = a[0] > b[0] || (a[0] === b[0] && a[1] < b[1]);
      if (!inOrder) seen.inversions.push([seen.samples, a, b]);
    }
    const text = count.textContent;
    if (seen.counts[seen.counts.length - 1] !== text) seen.counts.push(text);
  };
  new MutationObserver(check).observe(body, { childList: true });
  const all = { childList: true, characterData: true, subtree: true };
  new MutationObserver(check).observe(count, all);
  check();
}"""


@pytest.mark.timeout(900)  # against a hang: 40 runs on a loaded machine
async def test_the_runs_list_keeps_its_order_count_and_ages_while_40_runs_churn(
    rig: Rig,
) -> None:
    nc = await rig.stack.client()
    page = await opened(rig, "runs")
    count = page.locator(".pager span")  # "N runs in all"
    await expect(count).to_have_text(re.compile(r"^\d+ runs in all$"), timeout=WAIT_MS)
    before = int((await count.inner_text()).split()[0])
    await page.evaluate(WATCH_THE_LIST)

    # Submitted one after another while the first ones run: by the time they run, change
    # and end, the first 15 are off the first page.
    run_ids = [await submit(nc, short()) for _ in range(CHURN)]
    for run_id in run_ids:
        await finished(nc, run_id, HANG_S)
    seen = await page.evaluate("window.listSeen")
    assert seen["samples"] > CHURN, f"too few changes of the list seen: {seen['samples']}"
    assert seen["inversions"] == [], f"out of order at: {json.dumps(seen['inversions'][:5])}"

    # The count followed every new run without a reload, and ended at the whole history.
    total = before + CHURN
    await expect(count).to_have_text(f"{total} runs in all", timeout=WAIT_MS)

    # The list settles on the newest page, exactly as the server lists it.
    async def settled() -> bool:
        shown = await page.eval_on_selector_all(
            "#runs-body tr[data-run]", "rows => rows.map((tr) => tr.dataset.run)"
        )
        listed = [r["run_id"] for r in (await get(f"{rig.ui.url}api/runs?limit={PAGE}"))["runs"]]
        return bool(shown == listed and set(run_ids[-PAGE:]) <= set(shown))

    await eventually(settled, HANG_S, "the first page to be the newest runs", every=0.5)
    seen = await page.evaluate("window.listSeen")
    assert seen["inversions"] == [], f"out of order at: {json.dumps(seen['inversions'][:5])}"
    counts = [int(c.split()[0]) for c in seen["counts"] if c]
    assert counts == sorted(counts) and counts[-1] == total and len(counts) > 2, counts

    # Ages tick: a row the server sent no change of since shows another age later.
    ages = await page.eval_on_selector_all(
        "#runs-body tr[data-run]",
        "rows => rows.map((tr) => [tr.dataset.run, tr.dataset.seq,"
        " tr.querySelector('.changed').textContent])",
    )
    await page.wait_for_function(
        """(then) => then.some(([run, seq, text]) => {
          const tr = document.querySelector(`#runs-body tr[data-run="${run}"]`);
          return tr && tr.dataset.seq === seq && tr.querySelector(".changed").textContent !== text;
        })""",
        arg=ages,
        timeout=WAIT_MS,
    )
    await not_reloaded(page)
    await page.close()


async def test_a_finished_runs_ending_is_in_view_on_its_page(rig: Rig) -> None:
    nc = await rig.stack.client()
    done = await submit(nc, short())
    broken = await submit(
        nc,
        job(
            entry_point="tests.support.workloads:boom", total_steps=20,
            config={"boom_at": 3}, limits={"max_retries": 0},
        ),
    )  # fmt: skip
    assert (await finished(nc, done, HANG_S)).state == "COMPLETED"
    failed = await finished(nc, broken, HANG_S)
    assert failed.state == "FAILED" and failed.reason, failed
    page = await opened(rig, f"run/{done}")
    ending = page.locator("#run-ending")
    await expect(ending).to_contain_text("completed", timeout=WAIT_MS)
    await expect(ending).to_contain_text("at step 20")
    await expect(ending).to_be_in_viewport()
    await page.evaluate(f"location.hash = '#/run/{broken}'")
    await expect(ending).to_contain_text("failed", timeout=WAIT_MS)
    await expect(ending).to_contain_text(failed.reason)
    await expect(ending).to_be_in_viewport()
    assert await page.evaluate("window.scrollY") == 0, "seen without scrolling"
    await not_reloaded(page)
    await page.close()


async def poison(nc: Client, count: int, mark: str) -> None:
    """`count` submissions the dispatcher cannot read: each a dead letter."""
    js = nc.jetstream()
    for i in range(count):
        await js.publish(names.submit_subject("default"), f'{{"{mark}": {i}, "x'.encode())


async def letters(nc: Client) -> int:
    return int((await nc.jetstream().stream_info(names.DLQ_STREAM)).state.messages)


async def test_dead_letters_come_a_page_at_a_time(rig: Rig) -> None:
    nc = await rig.stack.client()
    held = await letters(nc)
    await poison(nc, 120, "paged")

    async def all_in() -> bool:
        return await letters(nc) >= held + 120

    await eventually(all_in, HANG_S, "120 dead letters", every=0.5)
    first = await request(rig.ui.url, "/api/dlq")
    assert first.status == 200, first
    shown = first.json()
    assert len(shown["letters"]) == PAGE and shown["total"] >= 120 and shown["next"], shown
    assert len(first.body) < 64_000, f"a page of {len(first.body)} bytes"
    second = await get(f"{rig.ui.url}api/dlq?after={shown['next']}")
    assert len(second["letters"]) == PAGE
    assert second["letters"][0]["seq"] > shown["letters"][-1]["seq"]

    page = await opened(rig, "dlq")
    rows = page.locator("#dlq-body tr[data-seq]")
    count = page.locator("#dlq-count")
    await expect(rows).to_have_count(PAGE, timeout=WAIT_MS)
    await expect(count).to_contain_text(re.compile(r"^1–25 of \d+ dead letters in all$"))
    top = await rows.first.get_attribute("data-seq")
    await page.locator("#dlq-next").click()
    await expect(count).to_contain_text(re.compile(r"^26–50 of "), timeout=WAIT_MS)
    await expect(rows).to_have_count(PAGE)
    assert int(await rows.first.get_attribute("data-seq") or 0) > int(top or 0)
    await page.locator("#dlq-previous").click()
    await expect(count).to_contain_text(re.compile(r"^1–25 of "), timeout=WAIT_MS)
    await expect(rows.first).to_have_attribute("data-seq", top or "")
    await not_reloaded(page)
    await page.close()


async def test_streams_sites_and_dead_letters_follow_the_hub_without_a_reload(
    rig: Rig,
) -> None:
    nc = await rig.stack.client()
    page = await opened(rig, "streams")
    held = page.locator(f'#streams tr[data-stream="{names.DLQ_STREAM}"] .messages')
    await expect(held).to_have_text(re.compile(r"^\d+$"), timeout=WAIT_MS)
    before = await held.inner_text()
    await poison(nc, 1, "streams")
    await expect(held).not_to_have_text(before, timeout=WAIT_MS)

    await page.evaluate("location.hash = '#/dlq'")
    count = page.locator("#dlq-count")
    await expect(count).to_contain_text("dead letters in all", timeout=WAIT_MS)
    while await page.locator("#dlq-next").is_enabled():  # to the last page, the newest
        shown = await count.inner_text()
        await page.locator("#dlq-next").click()
        await expect(count).not_to_have_text(shown, timeout=WAIT_MS)
    before = await count.inner_text()
    mark = f"live-{uuid.uuid4().hex[:8]}"
    await poison(nc, 1, mark)
    await expect(count).not_to_have_text(before, timeout=WAIT_MS)
    # On the last page, unless it was full: then the next page holds it.
    landed = page.locator("#dlq-body tr[data-seq]", has_text=mark)
    await expect(landed.or_(page.locator("#dlq-next:enabled"))).to_be_visible(timeout=WAIT_MS)

    await page.evaluate("location.hash = '#/sites'")
    await expect(page.locator("#sites .empty")).to_be_visible(timeout=WAIT_MS)
    site = Site(rig.stack, "lab1")
    await site.start(trainers=0)
    lab1 = page.locator('#sites tr[data-site="lab1"]')
    await expect(lab1).to_be_visible(timeout=WAIT_MS)
    await expect(lab1.locator(".link-cell")).to_have_text("up", timeout=WAIT_MS)
    await not_reloaded(page)
    await page.close()


async def test_an_action_with_a_stale_token_fails_on_the_page_and_changes_nothing(
    rig: Rig,
) -> None:
    """Run last: the dashboard is restarted under the page (same port, a new token)."""
    nc = await rig.stack.client()
    run_id = await submit(nc, short())
    await finished(nc, run_id, HANG_S)
    spec = job(total_steps=5)
    await post_letter(
        nc.jetstream(), names.SUBMIT_STREAM, source="dispatcher",
        subject=names.submit_subject("default"), reason="stale-token letter",
        payload=encode(spec), headers={}, stream_seq=777_777, delivered=10,
    )  # fmt: skip
    page = await opened(rig, f"run/{run_id}")
    pins = page.locator("#checkpoints button.pin")
    await expect(pins.first).to_be_visible(timeout=WAIT_MS)

    port = int(rig.ui.url.rstrip("/").rpartition(":")[2])
    await rig.ui.stop()
    rig.ui = dashboard(rig.stack, port)
    assert await rig.ui.start(), f"baton ui did not start again:\n{rig.ui.output}"

    notice = page.locator("#notice")
    step = await pins.first.get_attribute("data-step")
    await pins.first.click()
    await expect(notice).to_be_visible(timeout=WAIT_MS)
    await expect(notice).to_contain_text(f"pinning checkpoint {step}")
    await expect(notice).to_contain_text("stale")
    await expect(notice).to_be_in_viewport()
    await expect(page.locator("#notice-reload")).to_be_visible()
    await expect(pins.first).to_be_enabled()  # given back, to try again after a reload
    rows = await get(f"{rig.ui.url}api/runs/{run_id}/checkpoints")
    assert not any(r["pinned"] for r in rows), rows

    await page.locator("#notice .dismiss").click()
    await expect(notice).to_be_hidden()
    await page.evaluate("location.hash = '#/dlq'")
    letter = page.locator("#dlq-body tr[data-seq]", has_text="stale-token letter")
    await expect(page.locator("#dlq-body tr[data-seq]").first).to_be_visible(timeout=WAIT_MS)
    while not await letter.count():
        shown = await page.locator("#dlq-count").inner_text()
        await page.locator("#dlq-next").click()
        await expect(page.locator("#dlq-count")).not_to_have_text(shown, timeout=WAIT_MS)
    await letter.locator("button.replay").click()
    await expect(notice).to_contain_text("replaying dead letter", timeout=WAIT_MS)
    await expect(notice).to_contain_text("stale")
    await expect(letter.locator(".status")).to_contain_text("stale")
    seq = await letter.get_attribute("data-seq")
    still = await request(rig.ui.url, f"/api/dlq?after={int(seq or 1) - 1}&limit=1")
    assert still.json()["letters"][0]["reason"] == "stale-token letter", still
    await not_reloaded(page)

    # Reloaded, the page acts again.
    async with page.expect_navigation():
        await page.locator("#notice-reload").click()
    await page.evaluate(f"location.hash = '#/run/{run_id}'")
    await expect(pins.first).to_be_visible(timeout=WAIT_MS)
    await pins.first.click()
    await expect(page.locator("#checkpoints")).to_contain_text("yes", timeout=WAIT_MS)
    await expect(notice).to_be_hidden()
    await page.close()
