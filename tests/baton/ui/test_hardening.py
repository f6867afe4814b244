"""The dashboard against a real nats-server, spoken to as a hostile page would: a request for
another host gets nothing, an action from another origin is refused, every response forbids
framing, and what a URL names is checked before NATS sees it — never a wildcard, never a
500, and 404 for a run that does not exist."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client

from baton.client.errors import CliError
from baton.ui.server import serve
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.state.runs import Runs
from tests.support.dashboard import Reply, events, request

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
FRAMING = "frame-ancestors 'none'"


@dataclass
class Served:
    url: str
    host: str
    token: str

    async def get(self, path: str, **headers: str) -> Reply:
        return await request(self.url, path, headers=headers)

    async def post(self, path: str, **headers: str) -> Reply:
        return await request(self.url, path, method="POST", headers=headers)


@pytest.fixture
async def served(declared: Client, tmp_path: Path) -> AsyncIterator[Served]:
    """A dashboard on a free loopback port, over one finished run (`r00001`) whose output,
    and another run's before it, are in the logs stream."""
    runs = await Runs.open(declared.jetstream())
    for run_id in ("r00001", "r00002"):
        record = RunRecord(
            run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=1.0,
            updated_at=1.0, state=RunState.COMPLETED, step=5,
        )  # fmt: skip
        assert await runs.create(record)
    js = declared.jetstream()
    await js.publish(names.logs_subject("r00002"), b"the other run's output\n")
    await js.publish(names.logs_subject("r00001"), b"this run's output\n")
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(declared, f"file://{tmp_path}/store", "127.0.0.1", 0, ready.set_result)
    )
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 30)
        host = url.removeprefix("http://").rstrip("/")
        page = await request(url, "/")
        found = re.search(r'name="baton-token" content="([^"]+)"', page.body.decode())
        assert page.status == 200 and found, page
        yield Served(url, host, found.group(1))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_request_for_another_host_gets_no_page_and_no_api_answer(
    served: Served,
) -> None:
    port = served.host.rpartition(":")[2]
    for path in (
        "/", "/api/meta", "/api/runs", "/api/dlq", "/api/workers", "/api/runs/r00001",
        "/api/live", "/api/runs/r00001/logs", "/static/app.js",
    ):  # fmt: skip
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.io:{port}"):
            reply = await served.get(path, Host=host)
            assert reply.status == 421, (path, host, reply)
            assert reply.headers["content-type"].startswith("text/plain"), reply
            assert served.token.encode() not in reply.body
            assert b"r00001" not in reply.body, reply.body
            assert FRAMING in reply.headers["content-security-policy"]
    # An action for another host is refused before its origin or token is looked at.
    evil = f"http://evil.example:{port}"
    reply = await served.post(
        "/api/dlq/1/replay", Host=f"evil.example:{port}", Origin=evil,
        **{"X-Baton-Token": served.token},
    )  # fmt: skip
    assert reply.status == 421, reply
    # The names it is served on are answered.
    for host in (served.host, f"localhost:{port}"):
        reply = await served.get("/", Host=host)
        assert reply.status == 200 and served.token.encode() in reply.body, host
    assert (await served.get("/api/meta")).json()["refused"] >= 28


async def test_an_action_from_another_origin_or_none_is_refused(served: Served) -> None:
    token = {"X-Baton-Token": served.token}
    own, port = f"http://{served.host}", served.host.rpartition(":")[2]
    for path in ("/api/dlq/1/replay", "/api/runs/r00001/checkpoints/5/pin"):
        assert (await served.post(path, **token)).status == 403  # no Origin at all
        for origin in ("http://evil.example", f"http://evil.example:{port}", "null", own + "/"):
            reply = await served.post(path, Origin=origin, **token)
            assert reply.status == 403, (path, origin, reply)
            assert "Origin" in reply.json()["error"]
        reply = await served.post(path, Origin=own)  # its own origin, but no token
        assert reply.status == 403 and "token" in reply.json()["error"], reply
    # From its own page, with its token, an action goes through (to the store or NATS).
    reply = await served.post("/api/dlq/1/replay", Origin=own, **token)
    assert reply.status == 404 and "no dead letter #1" in reply.json()["error"], reply
    reply = await served.post("/api/runs/r00001/checkpoints/5/pin", Origin=own, **token)
    assert reply.status == 404 and "no committed checkpoint" in reply.json()["error"], reply


async def test_an_action_with_a_stale_or_no_token_is_refused_saying_why(served: Served) -> None:
    """Each reason is one the page shows as it is: a page from before a restart of the
    dashboard (another token) is told its token is stale, one without a token that it has
    none; both are told to reload, and nothing is done."""
    own = f"http://{served.host}"
    stale = {"X-Baton-Token": "a-token-of-an-earlier-start", "Origin": own}
    for path in ("/api/dlq/1/replay", "/api/runs/r00001/checkpoints/5/pin"):
        reply = await served.post(path, **stale)
        assert reply.status == 403, (path, reply)
        assert "stale" in reply.json()["error"] and "reload" in reply.json()["error"], reply
        assert reply.json()["reload"] is True, reply
        reply = await served.post(path, Origin=own)
        assert reply.status == 403, (path, reply)
        assert "did not carry" in reply.json()["error"] and reply.json()["reload"] is True


async def test_every_response_forbids_framing_and_sniffing(served: Served) -> None:
    for path, status in (
        ("/", 200), ("/api/runs", 200), ("/static/app.js", 200), ("/api/runs/nope", 404),
        ("/api/runs?limit=abc", 400), ("/nowhere", 404),
    ):  # fmt: skip
        reply = await served.get(path)
        assert reply.status == status, (path, reply)
        assert FRAMING in reply.headers["content-security-policy"], path
        assert reply.headers["x-frame-options"] == "DENY", path
        assert reply.headers["x-content-type-options"] == "nosniff", path
    assert "no-store" in (await served.get("/")).headers["cache-control"]  # it holds the token


async def test_bad_run_ids_and_parameters_get_400_never_a_wildcard_or_a_500(
    served: Served,
) -> None:
    for path in (
        "/api/runs/%3E/logs", "/api/runs/*/logs", "/api/runs/r00001.*/logs",
        "/api/runs/%3E", "/api/runs/*", "/api/runs/%3E/live", "/api/runs/a.b.c/checkpoints",
        "/api/runs/%20/logs", "/api/runs?limit=abc", "/api/runs?limit=0",
        "/api/runs?limit=201", "/api/runs?limit=-1", "/api/runs?after=abc",
        "/api/runs?after=nan:r1", "/api/runs?after=1.5:%3E", "/api/runs?state=exploded",
        "/api/live?since=abc",
    ):  # fmt: skip
        reply = await served.get(path)
        assert reply.status == 400, (path, reply)
        assert reply.json()["error"], path
    token = {"X-Baton-Token": served.token, "Origin": f"http://{served.host}"}
    for path in (
        "/api/dlq/abc/replay", "/api/dlq/0/replay", f"/api/dlq/{'9' * 25}/replay",
        "/api/runs/%3E/checkpoints/5/pin", "/api/runs/r00001/checkpoints/x/pin",
    ):  # fmt: skip
        reply = await served.post(path, **token)
        assert reply.status == 400, (path, reply)
    assert (await served.get("/api/runs?limit=200")).status == 200


async def test_the_logs_and_page_of_a_run_that_does_not_exist_get_404(served: Served) -> None:
    for path in (
        "/api/runs/nope/logs", "/api/runs/nope", "/api/runs/nope/live",
        "/api/runs/alice.nope/logs", "/api/runs/nope/checkpoints",
    ):  # fmt: skip
        reply = await served.get(path)
        assert reply.status == 404, (path, reply)
        assert "nope" in reply.json()["error"], path


async def test_a_runs_output_is_its_own(served: Served) -> None:
    """Its subject names the run alone: the other run's output, stored first, never comes."""
    stream = events(served.url, "/api/runs/r00001/logs")
    kind, text = await anext(stream)
    await stream.aclose()
    assert (kind, text) == ("log", "this run's output\n")


async def test_allowed_names_are_answered_and_a_bad_one_stops_the_start(
    declared: Client, tmp_path: Path
) -> None:
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(declared, None, "127.0.0.1", 0, ready.set_result, ["baton.example"])
    )
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 30)
        port = url.rstrip("/").rpartition(":")[2]
        for host, status in (
            (f"baton.example:{port}", 200), ("baton.example", 200),
            (f"evil.example:{port}", 421), (f"baton.example.evil.example:{port}", 421),
        ):  # fmt: skip
            assert (await request(url, "/api/runs", headers={"Host": host})).status == status
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    with pytest.raises(CliError) as refused:
        await serve(declared, None, "127.0.0.1", 0, ready.set_result, ["a/b"])
    assert refused.value.code == 2
