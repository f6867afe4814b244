"""The scheduler's queue, credits and pools' table as people see them, against a real stack
under `baton up`'s authorization with ONE trainer and a priced pool with priority classes
(`BATON_POOLS_FILE`; `min_run_s` long enough that nothing is preempted during the test):

* a resume the owner's credits cannot hold again is refused at once, with the dispatcher's
  reason, rather than waited out;
* while a submitter's long run holds the trainer, three operator runs at priorities low,
  high and the default wait in the order high, default, low — the high one for a trainer,
  the others behind higher priority runs — in `baton queue` (as the operator and as the
  submitter) and on the dashboard's Queue page, whose owners table shows the submitter's
  credits; `baton credits` tops up once and reads balances as each role may; `baton pools`
  shows the table in force and refuses a bad one, applying nothing;
* with the dispatcher down, `baton queue` says the scheduler is not answering (exit 1), the
  dashboard's API answers 503, and the Queue page says so.

Every wait is bounded only against a hang: nothing passes or fails on how fast it went.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from playwright.async_api import expect

from baton.client import calls as client
from baton.client import scheduling
from shared.bus.connect import connect
from shared.contracts import RunState
from shared.credentials import options_for, read_env_file
from shared.state.workers import live_workers
from tests.e2e.jobs import finished, paced, submit
from tests.support.cli import as_json, baton
from tests.support.dashboard import Rig, request, rigged
from tests.support.stack import Stack, all_dead, eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.sharing]
WAIT_MS = 120_000
"""Only against a hang: a loaded machine may take long, never this long."""
HANG_S = 120.0
POOLS = """\
[pools.default]
priorities = { low = -5, high = 10 }
max_priority = 10
min_run_s = 600
price = { "*" = 0.01 }
"""
"""One credit per 100 trainer-seconds; a hold is `estimate_s` x 1.25 x 0.01 credits."""
FOR_A_TRAINER = "waiting for a trainer of pool 'default'"


def behind_higher(why: str) -> bool:
    """Whether `why` says a run waits behind runs of higher priority
    (`shared.scheduling.plan.why_waiting`: "behind 1 run(s) of priority 10", …)."""
    return why.startswith("behind ") and "priority" in why


HELD: list[str] = []
"""Runs a test leaves PAUSED, for the queue test to cancel once it is over: no owned run
ends, and so none is settled, while the queue test reads its owner's balance."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    """One stack (one trainer, the pools file above), one `baton ui` as the dashboard, one
    browser; all stopped however the tests end."""
    root = tmp_path_factory.mktemp("queue")
    (root / "pools.toml").write_text(POOLS)
    pools = {"BATON_POOLS_FILE": str(root / "pools.toml")}
    async with rigged(root, trainers=1, env=pools) as rig:
        yield rig


def submitter_env(stack: Stack) -> str:
    return str(stack.root / "auth" / "submitter.env")


async def as_submitter(stack: Stack) -> Client:
    """A connection as the stack's submitter (user `submitter`: the owner of its runs)."""
    creds = read_env_file(Path(submitter_env(stack)))
    nc = await connect(stack.hub.url, "test-submitter", first_attempt_timeout=10,
                       options=options_for(creds))  # fmt: skip
    stack.clients.append(nc)  # closed when the stack stops
    return nc


async def cancelled(nc: Client, *run_ids: str) -> None:
    for run_id in run_ids:
        record = await client.record(nc, run_id)
        if not record.state.terminal:
            await client.cancel(nc, run_id, "the test is over")
    for run_id in run_ids:
        await finished(nc, run_id, HANG_S)


async def test_a_resume_the_owners_credits_cannot_hold_again_is_refused_at_once(
    rig: Rig,
) -> None:
    s = rig.stack
    nc = await s.client()
    code, out, err = await baton(s, "credits", "topup", "submitter", "1.5", "--id", "first")
    assert code == 0, err
    assert out.strip() == "topped up submitter by 1.5 credits; submitter's balance: 1.5 credits"
    code, out, err = await baton(s, "credits", "topup", "submitter", "1.5", "--id", "first")
    assert code == 0 and "top-up first was already written" in out, (out, err)

    run_id = await submit(await as_submitter(s), paced(100_000, estimate_s=100))
    kept = False
    try:
        account = (await scheduling.accounts(nc, "submitter"))["submitter"]
        assert (account.balance, account.holds) == (250_000, {run_id: 1_250_000}), account

        # Paused once it has trained a few steps: a resume reckons what is left at the run's
        # own pace (far past its hold), not at its estimate (which its hold still covers).
        async def training() -> bool:
            workers = await live_workers(nc.jetstream())
            return any(w.run_id == run_id and (w.step or 0) >= 3 for w in workers)

        await eventually(training, HANG_S, f"{run_id} to train a few steps", every=0.5)
        code, out, err = await baton(s, "pause", run_id)
        assert code == 0 and "PAUSED" in out, (out, err)
        # A wait far longer than the command may take here (`baton` gives it 180 s): it
        # ends at the dispatcher's refusal, not at the end of the wait.
        code, out, err = await baton(s, "resume", run_id, "--wait", "3600")
        assert code == 1, (out, err)
        assert err.startswith(f"error: run {run_id}: resume refused: submitter's balance of "
                              "0.25 credits is short of the "), err  # fmt: skip
        assert err.count("\n") == 1, err
        assert (await client.record(nc, run_id)).state is RunState.PAUSED
        HELD.append(run_id)
        kept = True
    finally:
        if not kept:
            await cancelled(nc, run_id)


async def test_the_queue_in_order_with_reasons_credits_and_pools(rig: Rig) -> None:
    s = rig.stack
    nc = await s.client()
    code, _, err = await baton(s, "credits", "topup", "submitter", "100", "--id", "second")
    assert code == 0, err
    before = (await scheduling.accounts(nc, "submitter"))["submitter"].balance

    # The submitter's long run takes the one trainer (a hold of 3600 x 1.25 x 0.01 = 45).
    long = await submit(await as_submitter(s), paced(100_000, estimate_s=3600))
    ids: dict[str, str] = {}
    try:

        async def training() -> bool:
            view = await scheduling.queue_view(nc, "default")
            return [t.run_id for t in view.training] == [long]

        await eventually(training, HANG_S, "the long run to train", every=0.5)
        for priority in ("low", "high", "default"):
            spec = paced(100) if priority == "default" else paced(100, priority=priority)
            ids[priority] = await submit(nc, spec)

        async def three() -> bool:
            return len((await scheduling.queue_view(nc, "default")).waiting) == 3

        await eventually(three, HANG_S, "three runs waiting", every=0.5)
        why = await check_the_queue(s, long, ids)
        own = await check_credits(s, long, before)
        await check_pools(s)
        await check_the_page(rig, ids, why, own)
    finally:
        await cancelled(nc, long, *ids.values(), *HELD)
        HELD.clear()


async def check_the_queue(s: Stack, long: str, ids: dict[str, str]) -> list[str]:
    """The order and reasons `baton queue` gives, the same to the operator and to the
    submitter; the reasons, in order."""
    order = [ids["high"], ids["default"], ids["low"]]
    said: list[list[str]] = []
    for who in ((), ("--auth-file", submitter_env(s))):  # the operator, the submitter
        view = await as_json(s, *who, "queue")
        waiting = view["waiting"]
        assert [(w["run_id"], w["priority"]) for w in waiting] == list(
            zip(order, (10, 0, -5), strict=True)
        ), (who, waiting)
        why = [w["waiting"] for w in waiting]
        assert why[0] == FOR_A_TRAINER and behind_higher(why[1]) and behind_higher(why[2]), why
        said.append(why)
        assert [(t["run_id"], t["owner"], t["worker"]) for t in view["training"]] == [
            (long, "submitter", "trainer-1")
        ], view["training"]
        assert {o["owner"] for o in view["owners"]} == {"", "submitter"}, view["owners"]
    assert said[0] == said[1], said
    code, out, err = await baton(s, "queue")
    assert code == 0, err
    assert out.splitlines()[0] == "pool default: 1 live trainer, 0 free; 3 waiting, 1 training"
    assert all(why.split()[0] in out for why in said[0]), out
    return said[0]


async def check_credits(s: Stack, long: str, before: int) -> Any:
    """Top-ups and reads as each role may; the submitter's own account as it printed it."""
    code, out, err = await baton(s, "credits", "topup", "alice", "5")
    assert code == 0 and out.strip().endswith("alice's balance: 5 credits"), (out, err)
    alice = await as_json(s, "credits", "--owner", "alice")
    assert (alice["balance"], alice["held"]) == (5.0, 0.0), alice
    assert [(e["kind"], e["amount"]) for e in alice["entries"]] == [("topup", 5.0)], alice

    own = await as_json(s, "--auth-file", submitter_env(s), "credits")
    assert own["owner"] == "submitter" and own["holds"][long] == 45.0, own
    assert own["balance_units"] == before - 45_000_000, (own, before)
    code, _, err = await baton(s, "--auth-file", submitter_env(s), "credits", "--owner", "alice")
    assert code == 2 and "submitter may read its own credits only" in err, err
    every = await as_json(s, "credits")
    assert {o["owner"] for o in every["owners"]} == {"alice", "submitter"}, every
    return own


async def check_pools(s: Stack) -> None:
    shown = await as_json(s, "pools", "show")
    default = shown["pools"]["default"]
    assert shown["revision"] > 0, shown
    assert default["priorities"] == {"low": -5, "high": 10}, default
    assert (default["max_priority"], default["min_run_s"], default["price"]) == (
        10, 600.0, {"*": 0.01},
    ), default  # fmt: skip

    same = s.root.parent / "pools.toml"
    code, out, err = await baton(s, "pools", "apply", str(same))
    assert code == 0 and out.startswith("unchanged: the table in force"), (out, err)
    bad = s.root.parent / "bad-pools.toml"
    bad.write_text("[pools.default]\npriorty = 3\n")
    code, out, err = await baton(s, "pools", "apply", str(bad))
    assert code == 2 and "priorty" in err and err.count("\n") == 1, (out, err)
    assert (await as_json(s, "pools", "show"))["revision"] == shown["revision"]


def js_number(credits: float) -> str:
    """How the page's script writes a number of credits."""
    return str(int(credits)) if credits == int(credits) else repr(credits)


async def check_the_page(rig: Rig, ids: dict[str, str], why: list[str], own: Any) -> None:
    """The Queue page shows the three in order with the reasons `baton queue` gave, and the
    submitter's credits as `baton credits` printed them."""
    page = await rig.browser.new_page()
    try:
        await page.goto(f"{rig.ui.url}#/runs")
        await page.locator("header a[data-view=queue]").click()
        rows = page.locator("#queue-waiting tr[data-run]")
        await expect(rows).to_have_count(3, timeout=WAIT_MS)
        for i, priority in enumerate(("high", "default", "low")):
            await expect(rows.nth(i)).to_have_attribute("data-run", ids[priority])
            await expect(rows.nth(i).locator("td.why")).to_have_text(why[i])
        await expect(page.locator("#queue-pool")).to_have_value("default")
        balance, held = js_number(own["balance"]), js_number(own["held"])
        cell = page.locator('#queue-owners tr[data-owner="submitter"] td.credits')
        await expect(cell).to_have_text(f"{balance} ({held} held)", timeout=WAIT_MS)
    finally:
        await page.close()
    assert (await request(rig.ui.url, "/api/queue?pool=a.b")).status == 400
    answer = await request(rig.ui.url, "/api/queue?pool=default")
    assert answer.status == 200, answer
    assert [w["run_id"] for w in answer.json()["view"]["waiting"]] == [
        ids["high"], ids["default"], ids["low"],
    ]  # fmt: skip


async def test_with_the_dispatcher_down_the_queue_says_the_scheduler_is_not_answering(
    rig: Rig,
) -> None:
    s = rig.stack
    pid = s.pid("dispatcher")
    s.signal("dispatcher", signal.SIGTERM)
    await all_dead([pid], "the dispatcher")
    code, out, err = await baton(s, "queue")
    assert code == 1, (out, err)
    assert err == "error: the scheduler (the dispatcher) is not answering for pool default\n"
    answer = await request(rig.ui.url, "/api/queue")
    assert answer.status == 503, answer
    assert answer.json() == {
        "error": "the scheduler (the dispatcher) is not answering for pool default"
    }, answer  # fmt: skip
    page = await rig.browser.new_page()
    try:
        await page.goto(f"{rig.ui.url}#/queue")
        await expect(page.locator("main p.error")).to_contain_text(
            "the scheduler (the dispatcher) is not answering for pool default", timeout=WAIT_MS
        )
    finally:
        await page.close()
