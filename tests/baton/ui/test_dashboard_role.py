"""The `dashboard` NATS role on a real nats-server with auth on, as `baton up` runs it: the
dashboard logged in as it answers every read its pages make and every action — replay, pin,
steering a run, a fork, a drain — with not one `Violation` in the server's log; and the role
can write nothing else."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from nats.aio.client import Client
from safetensors.torch import save

from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions, operator_options, vault
from baton.stack.servers import nats_server
from shared import credentials
from shared.bus import names
from shared.bus.answer import post_letter
from shared.bus.streams import ensure
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import (
    CommitRequest,
    FileRef,
    JobSpec,
    RunRecord,
    RunState,
    convert,
    encode,
    run_id_for,
    spec_hash,
)
from shared.contracts.control import WorkerInfo
from shared.contracts.events import Accepted, Completed, Started
from shared.contracts.sites import SiteRecord
from shared.state import archive
from shared.state import hub as hub_facts
from shared.state.runs import Runs
from tests.support.dashboard import events, request, served
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
RUN, OLD = "r00001", "rarchived"


@dataclass
class Hub:
    server: NatsServer
    opts: StackOptions
    store_url: str
    errors: dict[str, list[str]] = field(default_factory=dict)
    clients: list[Client] = field(default_factory=list)

    async def as_user(self, user: str) -> Client:
        """A client as `user`, whose async errors (refusals) are kept under its name."""
        v = vault(self.opts)
        assert v is not None
        errors = self.errors.setdefault(user, [])

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            self.server.url, error_cb=on_error, allow_reconnect=False,
            **credentials.options_for(v.get(user)),
        )  # fmt: skip
        self.clients.append(nc)
        return nc

    def violations(self) -> list[str]:
        text = self.server.log_path.read_text(errors="replace")
        return [line for line in text.splitlines() if "Violation" in line]


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Hub]:
    """A hub's nats-server with `baton up`'s users, Baton's streams, and what the pages
    show: a finished run with events, output and a checkpoint, an archived run, a worker's
    heartbeat, a site, and two dead letters (one for a work queue, one for a site)."""
    opts = StackOptions(data_dir=tmp_path / "hub", port=0, ws_port=0)
    h = Hub(nats_server(opts), opts, f"file://{tmp_path / 'store'}")
    await h.server.start()
    try:
        op = await nats.connect(h.server.url, **operator_options(opts))
        h.clients.append(op)
        js = op.jetstream()
        await ensure(js)
        # Where the store is, said as the hub's checkpointer says it (`shared.state.hub`).
        checkpointer = await h.as_user("checkpointer")
        await hub_facts.say_store(checkpointer.jetstream(), hub_facts.store_info(h.store_url))
        record = RunRecord(
            run_id=RUN, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=1.0, updated_at=2.0,
            state=RunState.COMPLETED, step=5,
        )  # fmt: skip
        assert await (await Runs.open(js)).create(record)
        await archive.keep(js, RunRecord(
            run_id=OLD, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=0.5, updated_at=0.6,
            state=RunState.FAILED, step=3, reason="lost",
        ))  # fmt: skip
        for event in (
            Accepted(run_id=RUN, at=1.0, name="t", pool="default", total_steps=5),
            Started(run_id=RUN, at=1.1, worker="trainer-1", token=1, attempt=1, start_step=0),
            Completed(run_id=RUN, at=2.0, step=5, digest="d"),
        ):
            subject = names.event_subject(RUN, type(event).__name__.lower())
            await js.publish(subject, encode(event))
        await js.publish(names.logs_subject(RUN), b"step 5 of 5\n")
        beat = WorkerInfo(worker="trainer-1", pool="default", host="h", pid=1, device="cpu", at=2.0)
        await (await js.key_value(names.WORKERS_BUCKET)).put("trainer-1", encode(beat))
        site = SiteRecord(site="lab1", first_seen=1.0, last_hello=1.0, linked_at=1.0)
        await (await js.key_value(names.SITES_BUCKET)).put("lab1", encode(site))
        for subject in (names.submit_subject("default"), "baton.site.lab1.ckpt.commit.r9"):
            await post_letter(
                js, names.SUBMIT_STREAM, source="dispatcher", subject=subject,
                reason="max deliveries reached (10)", payload=encode(SPEC), headers={},
                stream_seq=len(subject), delivered=10,
            )  # fmt: skip
        await committed_checkpoint(h.store_url, RUN, step=5)
        yield h
    finally:
        for nc in h.clients:
            if not nc.is_closed:
                await nc.close()
        await h.server.stop()


async def committed_checkpoint(store_url: str, run_id: str, step: int) -> None:
    """A checkpoint committed as a trainer and the checkpointer would."""
    refs = []
    async with open_store(store_url) as store:
        for name in ("model.safetensors", "meta.json"):
            data = save({"w": torch.zeros(2)}) if name.endswith(".safetensors") else b"{}"
            key = commit.data_key(run_id, 1, step, name)
            await store.put_once(key, data)
            digest = hashlib.sha256(data).hexdigest()
            refs.append(FileRef(name=name, key=key, size=len(data), sha256=digest))
        request_ = CommitRequest(run_id=run_id, token=1, step=step, worker="w", files=refs)
        await commit.commit(store, request_)


async def first_event(url: str, path: str, kind: str) -> Any:
    stream = events(url, path)
    try:
        async for got, data in stream:
            if got == kind:
                return data
    finally:
        await stream.aclose()
    raise AssertionError(f"{path}: no {kind} event")


async def test_the_dashboard_role_does_all_the_page_offers_with_no_violation(hub: Hub) -> None:
    """…given no store: it asks the hub where its store is, as `baton ui` does with only
    NATS_URL and the dashboard's credentials."""
    nc = await hub.as_user("dashboard")
    async with served(nc, None) as url:
        page = await request(url, "/")
        found = re.search(r'name="baton-token" content="([^"]+)"', page.body.decode())
        assert page.status == 200 and found
        act = {"X-Baton-Token": found.group(1), "Origin": url.rstrip("/")}

        async def get(path: str) -> Any:
            reply = await request(url, path)
            assert reply.status == 200, (path, reply)
            return reply.json()

        listed = await get("/api/runs?state=completed&limit=10")
        assert [r["run_id"] for r in listed["runs"]] == [RUN]
        assert RUN in await get(f"/api/goodput?runs={RUN}")
        shown = await get(f"/api/runs/{RUN}")
        assert [a["worker"] for a in shown["attempts"]] == ["trainer-1"]
        assert (await get(f"/api/runs/{OLD}"))["record"]["state"] == "FAILED"
        assert await first_event(url, f"/api/runs/{RUN}/logs", "log") == "step 5 of 5\n"
        view = await first_event(url, f"/api/runs/{RUN}/live", "view")
        assert view["record"]["run_id"] == RUN
        summary = await first_event(url, "/api/live?since=0", "run")
        assert summary["run_id"] == RUN
        assert [w["worker"] for w in await get("/api/workers")] == ["trainer-1"]
        assert [s["site"] for s in await get("/api/sites")] == ["lab1"]
        streams = {s["name"] for s in await get("/api/streams")}
        assert {names.SUBMIT_STREAM, names.DLQ_STREAM, names.EVENTS_STREAM} <= streams
        # The fleet's pages, live: the sites bucket watched, streams and a page of letters.
        live = await first_event(url, "/api/sites/live", "view")
        assert [s["site"] for s in live["sites"]] == ["lab1"], live
        live = await first_event(url, "/api/streams/live", "view")
        assert names.DLQ_STREAM in {s["name"] for s in live["streams"]}, live
        live = await first_event(url, "/api/dlq/live?limit=1", "view")
        assert len(live["letters"]) == 1 and live["total"] == 2 and live["next"], live

        # Pin a checkpoint (a write to the store).
        rows = await get(f"/api/runs/{RUN}/checkpoints")
        assert [(r["step"], r["pinned"]) for r in rows] == [(5, False)]
        pinned = await request(
            url, f"/api/runs/{RUN}/checkpoints/5/pin", method="POST", headers=act
        )
        assert pinned.status == 200, pinned
        rows = await get(f"/api/runs/{RUN}/checkpoints")
        assert [(r["step"], r["pinned"]) for r in rows] == [(5, True)]

        # Replay a dead letter to its work queue; one bound for a site is not replayed.
        letters = {x["subject"]: x["seq"] for x in (await get("/api/dlq"))["letters"]}
        to_queue = letters[names.submit_subject("default")]
        to_site = letters["baton.site.lab1.ckpt.commit.r9"]
        replayed = await request(url, f"/api/dlq/{to_queue}/replay", method="POST", headers=act)
        assert replayed.status == 200, replayed
        assert replayed.json()["subject"] == names.submit_subject("default")
        refused = await request(url, f"/api/dlq/{to_site}/replay", method="POST", headers=act)
        assert refused.status == 400 and "not a hub work queue" in refused.json()["error"]
        assert [x["seq"] for x in (await get("/api/dlq"))["letters"]] == [to_site]

    js = hub.clients[0].jetstream()
    resubmitted = await js.get_last_msg(names.SUBMIT_STREAM, names.submit_subject("default"))
    assert resubmitted.data == encode(SPEC)
    assert hub.errors["dashboard"] == []
    assert hub.violations() == [], "the dashboard role was refused what it asked for"


async def test_the_dashboard_role_writes_nothing_but_replays(hub: Hub) -> None:
    nc = await hub.as_user("dashboard")
    run_key = f"$KV.{names.RUNS_BUCKET}.{RUN}"
    for subject in (
        run_key, f"$KV.{names.LEASES_BUCKET}.{RUN}", f"$KV.{names.WORKERS_BUCKET}.w",
        names.event_subject(RUN, "completed"), names.logs_subject(RUN),
        f"$JS.API.STREAM.DELETE.{names.EVENTS_STREAM}", f"$JS.API.STREAM.PURGE.{names.DLQ_STREAM}",
        f"$JS.API.STREAM.MSG.DELETE.{names.EVENTS_STREAM}",
        f"$JS.API.STREAM.UPDATE.{names.TASKS_STREAM}", "$JS.API.STREAM.CREATE.X",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{names.TASKS_STREAM}.mine",
        f"$JS.API.CONSUMER.CREATE.{names.TASKS_STREAM}",
        f"$JS.API.DIRECT.GET.KV_{names.LEASES_BUCKET}.$KV.{names.LEASES_BUCKET}.{RUN}",
        "baton.control.trainer-1", "baton.archive.r1",
    ):  # fmt: skip
        await nc.publish(subject, b"{}")

        async def refused(subject: str = subject) -> bool:
            return any(
                "permissions violation" in e.lower() and subject.lower() in e.lower()
                for e in hub.errors["dashboard"]
            )

        await eventually(refused, 5, f"the server to refuse the dashboard {subject}")
    await nc.subscribe("baton.>")

    async def not_subscribed() -> bool:
        return any("subscription" in e.lower() for e in hub.errors["dashboard"])

    await eventually(not_subscribed, 5, "the server to refuse the dashboard baton.>")


async def test_the_dashboard_role_steers_forks_and_drains_with_no_violation(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's actions on runs and trainers, as the role: each request lands where the
    services take it (no dispatcher here: it stays queued), a refused one publishes nothing,
    and the server refused the role nothing."""
    from baton.ui import actions
    from shared.contracts import decode
    from shared.contracts.control import Drain, Pause, Rollback, Steer, TakeCheckpoint

    monkeypatch.setattr(actions, "FORK_WAIT_S", 0.5)  # no dispatcher will answer
    op = hub.clients[0].jetstream()
    live = "r00002"
    await (await Runs.open(op)).create(RunRecord(
        run_id=live, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=3.0, updated_at=3.0,
        state=RunState.RUNNING, worker="trainer-1", token=1, step=2,
    ))  # fmt: skip
    await committed_checkpoint(hub.store_url, live, step=2)
    nc = await hub.as_user("dashboard")
    async with served(nc, hub.store_url) as url:
        page = await request(url, "/")
        found = re.search(r'name="baton-token" content="([^"]+)"', page.body.decode())
        assert found
        act = {"X-Baton-Token": found.group(1), "Origin": url.rstrip("/")}

        async def post(path: str) -> Any:
            return await request(url, path, method="POST", headers=act)

        async def steered() -> int:
            return (await op.stream_info(names.CANCEL_STREAM)).state.last_seq

        for path, want in (("pause", Pause), ("checkpoint", TakeCheckpoint)):
            done = await post(f"/api/runs/{live}/{path}")
            assert done.status == 200, done
            msg = await op.get_last_msg(names.CANCEL_STREAM, names.steer_subject(live))
            assert isinstance(decode(msg.data or b"", Steer), want)
        before = await steered()
        refused = await post(f"/api/runs/{live}/resume")  # it is not paused
        assert refused.status == 400 and "only a paused run resumes" in refused.json()["error"]
        missing = await post(f"/api/runs/{live}/checkpoints/7/rollback")
        assert missing.status == 404, missing
        assert "no committed checkpoint at step 7" in missing.json()["error"]
        assert await steered() == before, "a refused action published nothing"
        back = await post(f"/api/runs/{live}/checkpoints/2/rollback")
        assert back.status == 200, back
        msg = await op.get_last_msg(names.CANCEL_STREAM, names.steer_subject(live))
        assert decode(msg.data or b"", Steer) == Rollback(
            run_id=live, step=2, reason="rolled back from the dashboard"
        )

        submitted = (await op.stream_info(names.SUBMIT_STREAM)).state.last_seq
        over = await post(f"/api/runs/{RUN}/checkpoints/5/fork")  # its final step
        assert over.status == 400 and "nothing is left to train" in over.json()["error"]
        assert (await op.stream_info(names.SUBMIT_STREAM)).state.last_seq == submitted
        fork = await post(f"/api/runs/{live}/checkpoints/2/fork")
        assert fork.status == 200, fork
        forked = fork.json()["run_id"]
        sent = await op.get_last_msg(names.SUBMIT_STREAM, names.submit_subject("default"))
        spec = decode(sent.data or b"", JobSpec)
        assert spec.fork is not None and (spec.fork.run_id, spec.fork.step) == (live, 2)
        assert run_id_for(spec.idempotency_key or "") == forked  # an operator's: no owner

        assert (await post("/api/workers/trainer-1/drain")).status == 200
        drains = await op.key_value(names.DRAINS_BUCKET)
        assert decode((await drains.get("trainer-1")).value or b"", Drain).worker == "trainer-1"
        assert (await post("/api/workers/trainer-1/undrain")).status == 200
        again = await post("/api/workers/trainer-1/undrain")
        assert again.status == 400 and "not drained" in again.json()["error"]
        assert (await post("/api/workers/*/drain")).status == 400
    assert hub.errors["dashboard"] == []
    assert hub.violations() == [], "the dashboard role was refused what it asked for"
