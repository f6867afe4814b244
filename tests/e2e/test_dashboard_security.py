"""The dashboard against the pages that would abuse it, in a real headless Chromium, next to
a real stack: `baton ui` beside `baton up` logs in as the `dashboard` role; a page on a
DNS-rebinding name can neither read the page's token nor list runs nor pin a checkpoint;
no site can frame it; a foreign origin's action is refused; and everything the page offers
works as the role, with no `Violation` in the server's log."""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from playwright.async_api import Browser, ConsoleMessage, expect

from shared.bus import names
from shared.bus.answer import post_letter
from shared.contracts import encode
from tests.e2e.jobs import finished, job, submit
from tests.support.dashboard import UiProcess, browser, request
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.asyncio(loop_scope="module")]
WAIT_MS = 60_000
EVIL = "evil.example"


@dataclass
class Rig:
    stack: Stack
    ui: UiProcess
    browser: Browser
    run_id: str

    @property
    def port(self) -> int:
        return int(self.ui.url.rstrip("/").rpartition(":")[2])

    async def pinned(self) -> set[int]:
        rows = (await request(self.ui.url, f"/api/runs/{self.run_id}/checkpoints")).json()
        return {r["step"] for r in rows if r["pinned"]}

    def violations(self) -> list[str]:
        return [
            line
            for log in sorted(self.stack.root.rglob("nats-server.log"))
            for line in log.read_text(errors="replace").splitlines()
            if "Violation" in line
        ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    """A stack in `<root>/.baton`, as `baton up` leaves it, one finished run with output and
    three checkpoints, and `baton ui` started in `<root>` with no credentials named."""
    root = tmp_path_factory.mktemp("dashboard-security")
    s = Stack(root / ".baton", trainers=1)
    ui = UiProcess("ui", "--port", "0", "--server", "", "--store", s.store_url, cwd=root)
    try:
        await s.start()
        nc = await s.client()
        spec = job(
            entry_point="tests.support.workloads:chatty", total_steps=60,
            checkpoint={"every_steps": 20},
        )  # fmt: skip
        run_id = await submit(nc, spec)
        await finished(nc, run_id, 90)
        ui.args = tuple(s.nats.url if a == "" else a for a in ui.args)
        assert await ui.start(), f"baton ui did not start:\n{ui.output}"
        async with browser() as b:
            yield Rig(s, ui, b, run_id)
    finally:
        await ui.stop()
        await s.stop()


async def test_baton_ui_next_to_baton_up_logs_in_as_the_dashboard(rig: Rig) -> None:
    assert "NATS user dashboard" in rig.ui.output, rig.ui.output


ATTACK = """async ([run, token]) => {
  const out = {};
  const page = await fetch("/");
  const text = await page.text();
  out.page = page.status;
  out.token = (text.match(/baton-token" content="([^"]+)"/) || [])[1] || null;
  out.body = text.slice(0, 200);
  out.runs = (await fetch("/api/runs")).status;
  out.dlq = (await fetch("/api/dlq")).status;
  out.logs = (await fetch(`/api/runs/${run}/logs`)).status;
  for (const [name, t] of [["pin", out.token || "none"], ["pin_with_token", token]]) {
    const r = await fetch(`/api/runs/${run}/checkpoints/20/pin`,
      { method: "POST", headers: { "X-Baton-Token": t } });
    out[name] = r.status;
  }
  return out;
}"""


async def test_a_dns_rebinding_page_can_neither_read_the_token_nor_pin(rig: Rig) -> None:
    """The attacker's name now resolves to this machine (Chromium's resolver rules play the
    DNS), so a page of that name's origin — the attacker's, on the dashboard's port — is
    same-origin with what it fetches from the dashboard: it gets no answer. (Chromium's own
    guard against public pages reaching local addresses is not what stops it: the page here
    was itself loaded from this machine.)"""
    real = await request(rig.ui.url, "/")
    token = re.search(r'baton-token" content="([^"]+)"', real.body.decode())
    assert token
    async with browser(f"--host-resolver-rules=MAP {EVIL} 127.0.0.1") as rebinding:
        page = await rebinding.new_page()
        shown = await page.goto(f"http://{EVIL}:{rig.port}/")
        assert shown is not None and shown.status == 421
        assert await page.locator('meta[name="baton-token"]').count() == 0
        out = await page.evaluate(ATTACK, [rig.run_id, token.group(1)])
        # The name reaches the dashboard itself: its refusal is what answered.
        assert "answers only to the names it is served on" in out["body"], out
        assert out["token"] is None, out
        assert {k: out[k] for k in ("page", "runs", "dlq", "logs", "pin", "pin_with_token")} == {
            "page": 421, "runs": 421, "dlq": 421, "logs": 421, "pin": 421,
            "pin_with_token": 421,
        }  # fmt: skip
        # Its own names still work in the same browser.
        assert (await page.goto(rig.ui.url)) is not None
        await expect(page.locator('meta[name="baton-token"]')).to_have_count(1)
    assert 20 not in await rig.pinned()


class Framer:
    """Another site's page (another origin, on this machine) that frames the dashboard."""

    def __init__(self, target: str) -> None:
        body = f'<iframe id="victim" src="{target}"></iframe>'.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://localhost:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Framer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


async def test_no_site_can_frame_the_dashboard(rig: Rig) -> None:
    page = await rig.browser.new_page()
    refusals: list[str] = []

    def seen(message: ConsoleMessage) -> None:
        if "frame-ancestors" in message.text:
            refusals.append(message.text)

    page.on("console", seen)
    with Framer(rig.ui.url) as framer:
        await page.goto(framer.url)

        async def refused() -> bool:
            return bool(refusals)

        await eventually(refused, 30, "Chromium to refuse framing the dashboard")
    assert "'none'" in refusals[0], refusals
    for child in page.frames[1:]:
        assert await child.locator('meta[name="baton-token"]').count() == 0
    await page.close()


async def test_an_action_with_a_foreign_origin_is_refused(rig: Rig) -> None:
    page = await rig.browser.new_page()
    await page.goto(rig.ui.url)
    token = await page.get_attribute('meta[name="baton-token"]', "content") or ""
    pin = f"{rig.ui.url}api/runs/{rig.run_id}/checkpoints/20/pin"
    for origin in (f"http://{EVIL}", f"http://{EVIL}:{rig.port}", "null"):
        refused = await page.request.post(pin, headers={"X-Baton-Token": token, "Origin": origin})
        assert refused.status == 403, origin
    no_origin = await page.request.post(pin, headers={"X-Baton-Token": token})
    assert no_origin.status == 403
    assert 20 not in await rig.pinned()
    await page.close()


async def test_everything_the_page_offers_works_as_the_dashboard_role(rig: Rig) -> None:
    """Every view, both actions, from the page itself; then not one request of the
    dashboard's was refused by the server."""
    nc = await rig.stack.client()
    spec = job(total_steps=5)
    await post_letter(
        nc.jetstream(), names.SUBMIT_STREAM, source="dispatcher",
        subject=names.submit_subject("default"), reason="max deliveries reached (10)",
        payload=encode(spec), headers={"Nats-Msg-Id": spec.idempotency_key}, stream_seq=7,
        delivered=10,
    )  # fmt: skip
    page = await rig.browser.new_page()
    blocked: list[str] = []  # what the page's own policy kept it from doing
    page.on("console", lambda m: blocked.append(m.text) if "Security Policy" in m.text else None)
    await page.goto(f"{rig.ui.url}#/runs")
    await expect(page.locator("#link")).to_have_text("live", timeout=WAIT_MS)
    row = page.locator(f'tr[data-run="{rig.run_id}"]')
    await expect(row.locator(".goodput-cell")).to_contain_text("%", timeout=WAIT_MS)

    await row.locator("a").click()
    await expect(page.locator("#run-state .state")).to_have_text("COMPLETED", timeout=WAIT_MS)
    await expect(page.locator("#logs")).to_contain_text("chatty: at step 50", timeout=WAIT_MS)
    pin_40 = page.locator(
        "#checkpoints tr", has=page.locator("td.num", has_text=re.compile("^40$"))
    )
    await pin_40.locator("button").click()
    await expect(pin_40).to_contain_text("yes", timeout=WAIT_MS)
    assert 40 in await rig.pinned()

    for view, shown in (
        ("workers", "#workers-body tr[data-worker]"), ("sites", "main p.empty"),
        ("streams", f'tr[data-stream="{names.SUBMIT_STREAM}"]'), ("dlq", "tr[data-seq]"),
    ):  # fmt: skip
        await page.locator(f"header a[data-view={view}]").click()
        await expect(page.locator(shown).first).to_be_visible(timeout=WAIT_MS)
    letter = page.locator("tr[data-seq]", has_text="max deliveries reached (10)")
    await letter.locator("button.replay").click()
    await expect(letter).to_contain_text("replayed to baton.submit.default", timeout=WAIT_MS)
    await page.close()
    assert blocked == [], blocked

    meta = (await request(rig.ui.url, "/api/meta")).json()
    assert meta["reads"] > 0, json.dumps(meta)
    assert "nats: timeout" not in rig.ui.output
    assert rig.violations() == [], "the dashboard role was refused what the page asked for"
