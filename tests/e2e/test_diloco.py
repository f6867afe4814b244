"""One run across sites: a replicated (DiLoCo) run of the character language model, its
replicas' changes meeting in outer rounds through the store (docs/diloco.md).

The hub (dispatcher, checkpointer, reaper, one trainer) and the site `lab1` (leaf node in
its own domain, checkpointer, two trainers) are real processes under `baton up`'s default
authorization; the store is a real SeaweedFS. The site reaches the hub's WebSocket and the
store each through a proxy, both cut at once to cut the site off. Every stack's logs are
scanned for permission violations and JetStream API timeouts when it stops.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from nats.aio.client import Client
from playwright.async_api import expect

from shared.checkpoint import commit, rounds
from shared.checkpoint.digest import weights_digest
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import Restored, Round
from shared.contracts.records import replica_run_id
from shared.contracts.rounds import RoundManifest, RoundNote
from tests.e2e.jobs import finished, history, job, submit
from tests.support.cli import as_json, baton
from tests.support.dashboard import browser, served
from tests.support.proxy import Proxy
from tests.support.seaweed import SeaweedS3
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.diloco, pytest.mark.timeout(600)]

HUB = ("dispatcher", "checkpointer", "reaper")
TTL = 6
H = 10


def lm(total: int, replicas: int = 3, every: int = 4, **outer: Any) -> JobSpec:
    """The character LM (a data loader, AdamW, a cosine schedule), small enough for two
    cores, replicated."""
    return job(
        name="diloco",
        entry_point="examples.charlm:train",
        total_steps=total,
        seed=5,
        checkpoint={"every_steps": every},
        config={
            "num_workers": 0,
            "window": 32,
            "stride": 8,
            "batch": 16,
            "embed": 16,
            "hidden": 64,
            "dropout": 0.0,
            "lr": 0.01,
        },
        replicas=replicas,
        outer={"inner_steps": H, "round_deadline_s": 3.0, **outer},
    )


@pytest.fixture
def seaweed(monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        for name, value in server.env().items():  # this process's own look into the store
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture
async def hub(tmp_path: Path, seaweed: SeaweedS3) -> AsyncIterator[Stack]:
    env = {**seaweed.env(), "BATON_STORE": seaweed.url(f"diloco-{uuid.uuid4().hex[:8]}")}
    s = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL, env=env)
    await s.start(HUB)
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def site(hub: Stack, seaweed: SeaweedS3) -> AsyncIterator[tuple[Site, Proxy]]:
    """lab1 with two trainers, its store behind a proxy of its own."""
    host, port = seaweed.endpoint.removeprefix("http://").rsplit(":", 1)
    store = Proxy(host, int(port))
    await store.start()
    s = Site(hub, "lab1", env={"BATON_S3_ENDPOINT": f"http://127.0.0.1:{store.port}"})
    try:
        await s.start(trainers=2)
        yield s, store
    finally:
        await store.stop()


def cut(site: Site, store: Proxy) -> None:
    site.proxy.sever()
    store.sever()


def heal(site: Site, store: Proxy) -> None:
    store.restore()
    site.proxy.restore()


async def the_log(hub: Stack, run_id: str) -> list[RoundManifest]:
    async with open_store(hub.store_url) as s:
        log = rounds.Log(s, run_id)
        await log.refresh()
        return log.manifests


async def notes(nc: Client, run_id: str, replicas: int) -> dict[int, list[RoundNote]]:
    out = {}
    for i in range(replicas):
        events = await history(nc, replica_run_id(run_id, i))
        out[i] = [e.note for e in events if isinstance(e, Round)]
    return out


async def all_finished(nc: Client, run_id: str, replicas: int, timeout: float) -> list[RunRecord]:
    return [await finished(nc, replica_run_id(run_id, i), timeout) for i in range(replicas)]


def assert_each_change_once(manifests: list[RoundManifest], replicas: int) -> None:
    """The log is complete and nothing is applied twice: rounds 1..n in order, every change
    in at most one round, each round's changes in replica order and of distinct replicas."""
    assert [m.round for m in manifests] == list(range(1, len(manifests) + 1))
    seen: set[tuple[int, int]] = set()
    for m in manifests:
        assert m.changes, m
        order = [c.replica for c in m.changes]
        assert order == sorted(set(order)) and all(r < replicas for r in order), m
        for c in m.changes:
            assert (c.replica, c.base) not in seen, f"{c} applied twice"
            assert c.base < m.round, c
            seen.add((c.replica, c.base))


async def replayed_is_final(hub: Stack, run_id: str, spec: JobSpec, last: RunRecord) -> None:
    """Acceptance 4: the round log replayed from the start gives the last round's bits, and
    those are the weights in the final checkpoint of a replica that ended at that round."""
    async with open_store(hub.store_url) as s:
        params, count = await rounds.replay(s, run_id, spec.outer)
        found = await commit.read_latest(s, last.run_id)
        assert found is not None
        manifest = await commit.load_manifest(s, found[0].manifest)
        model = next(f for f in manifest.files if f.name.startswith("model"))
        data = await s.get(model.key)
    manifests = await the_log(hub, run_id)
    assert count == len(manifests) and weights_digest(params) == manifests[-1].result
    from safetensors.torch import load as tensors_from_bytes

    saved = tensors_from_bytes(data)  # named `<prefix>.<parameter>`
    by_name = {n: next(t for k, t in saved.items() if k.endswith(f".{n}")) for n in params}
    assert all(torch.equal(by_name[n].to(torch.float32), params[n]) for n in params), (
        "the final checkpoint's weights differ from the replayed round log"
    )


async def test_a_three_replica_run_across_hub_and_site_trains_and_replays(
    hub: Stack, site: tuple[Site, Proxy]
) -> None:
    """Acceptance 1 and 4: two replicas at the site, one at the hub; the run completes, its
    loss falls, every round's manifest is complete, and the log replays to its weights."""
    nc = await hub.client()
    await hub.add_trainer("trainer-1")
    # Nobody is cut off here: rounds wait for all three however loaded the machine (a
    # replica slow to start must not turn a round into one of two at a short deadline).
    spec = lm(60, round_deadline_s=120.0)
    run_id = await submit(nc, spec)
    done = await all_finished(nc, run_id, 3, timeout=300)
    assert all(r.state is RunState.COMPLETED for r in done), done
    assert sorted(bool(r.ending_site or r.site) for r in done) == [False, True, True], done
    manifests = await the_log(hub, run_id)
    got = await notes(nc, run_id, 3)
    assert len(manifests) == 60 // H, (manifests, got)
    assert_each_change_once(manifests, 3)
    assert all(len(m.changes) == 3 for m in manifests), "a round without a replica"
    for i, ns in got.items():
        assert [n.round for n in ns if n.outcome == "joined"] == list(range(1, 7)), (i, ns)
    losses = [e.metrics["loss"] for e in await history(nc, replica_run_id(run_id, 0))
              if type(e).__name__ == "Progress" and "loss" in e.metrics]  # fmt: skip
    assert losses[-1] < 0.8 * losses[0], losses
    await replayed_is_final(hub, run_id, spec, done[0])
    await shown(hub, run_id, rounds=60 // H)


async def shown(hub: Stack, run_id: str, rounds: int) -> None:
    """`baton status` and `baton rounds` of the replicated run, `--replay` included, and a
    replica's page on the dashboard (a real Chromium) show its rounds."""
    status = await as_json(hub, "status", run_id)
    assert status["state"] == "COMPLETED" and len(status["replicas"]) == 3, status
    assert [r["round"] for r in status["rounds"]] == list(range(1, rounds + 1)), status
    assert all(r["bytes"] > 0 for r in status["rounds"])
    shown = await as_json(hub, "rounds", run_id, "--replay")
    assert shown["replay"]["rounds"] == rounds, shown
    code, out, err = await baton(hub, "status", run_id)
    assert code == 0 and f"{rounds} committed" in out and "exchanged per round" in out, err
    reports = await as_json(hub, "report", run_id, "--out", str(hub.root / "reports"))
    pages = [Path(r["html"]) for r in reports["replicas"]]
    assert len(pages) == 3 and all("Rounds (replica" in p.read_text() for p in pages), reports
    nc = await hub.client()
    async with served(nc, hub.store_url) as url, browser() as b:
        page = await b.new_page()
        await page.goto(f"{url}#/run/{replica_run_id(run_id, 1)}")
        await expect(page.locator("#run-rounds tr.round")).to_have_count(rounds, timeout=30_000)
        await expect(page.locator("#run-rounds")).to_contain_text("replica 1 of 3")


async def test_a_cut_off_site_does_not_stall_the_hub_replica_and_its_changes_join_at_heal(
    hub: Stack, site: tuple[Site, Proxy]
) -> None:
    """Acceptance 2 (and 4 on its log): the site, both its replicas' trainers, cut off for
    several rounds; the hub replica's rounds close without them (the first at its deadline,
    the next without waiting for replicas that missed the last); the site's replicas train
    on; at heal their changes join a round; the run completes; no change is in two rounds,
    and the log replays to the final weights."""
    lab1, store = site
    nc = await hub.client()
    await hub.add_trainer("trainer-1")
    spec = lm(120, max_staleness=1000)
    run_id = await submit(nc, spec)

    async def placed() -> dict[int, RunRecord] | None:
        rs = {i: await finished_or_not(nc, replica_run_id(run_id, i)) for i in range(3)}
        running = all(r.state is RunState.RUNNING for r in rs.values())
        return rs if running else None

    where = await eventually(placed, 120, "the three replicas to train")
    at_hub = [i for i, r in where.items() if not r.site]
    assert len(at_hub) == 1, where
    await eventually(lambda: rounds_done(hub, run_id, 1), 120, "a first round of all three")
    cut(lab1, store)
    before = len(await the_log(hub, run_id))

    async def hub_alone() -> bool:
        alone = [m for m in (await the_log(hub, run_id))[before:] if len(m.changes) == 1]
        return len(alone) >= 3

    await eventually(hub_alone, 180, "three rounds of the hub replica alone")
    alone = [m for m in (await the_log(hub, run_id))[before:] if len(m.changes) == 1]
    # The first waited for the site's replicas until its deadline; later ones know them gone.
    assert alone[0].deadline and not alone[-1].deadline, alone
    site_replicas = sorted(set(range(3)) - set(at_hub))
    assert all(m.changes[0].replica == at_hub[0] and m.stragglers == site_replicas for m in alone)
    heal(lab1, store)
    done = await all_finished(nc, run_id, 3, timeout=360)
    assert all(r.state is RunState.COMPLETED for r in done), done
    manifests = await the_log(hub, run_id)
    assert_each_change_once(manifests, 3)
    got = await notes(nc, run_id, 3)
    for i in (i for i in range(3) if i not in at_hub):
        skipped = [n for n in got[i] if n.outcome == "skipped"]
        late = [n for n in got[i] if n.outcome == "joined" and n.round - 1 - n.base >= 2]
        assert skipped and late, (i, got[i])  # trained on through the cut; joined when back
    last = max(done, key=lambda r: r.updated_at)
    await replayed_is_final(hub, run_id, spec, last)


async def test_a_replica_killed_mid_round_resumes_from_its_inner_checkpoint(
    hub: Stack, site: tuple[Site, Proxy]
) -> None:
    """Acceptance 3: the hub replica's trainer SIGKILLed between two rounds; a new trainer
    resumes it from its last inner checkpoint (not the last round's step), it contributes to
    the rounds after, and the run completes with every change in at most one round."""
    nc = await hub.client()
    pid = await hub.add_trainer("trainer-1")
    spec = lm(80, every=7)  # inner checkpoints at steps no round falls on (but 70)
    run_id = await submit(nc, spec)

    async def hub_replica() -> tuple[int, RunRecord] | None:
        for i in range(3):
            r = await finished_or_not(nc, replica_run_id(run_id, i))
            if r.state is RunState.RUNNING and not r.site and r.step >= H + 4:
                return i, r
        return None

    victim, _ = await eventually(hub_replica, 180, "the hub replica past its first round")
    os.kill(pid, signal.SIGKILL)
    await hub.add_trainer("trainer-2")
    done = await all_finished(nc, run_id, 3, timeout=360)
    assert all(r.state is RunState.COMPLETED for r in done), done
    assert done[victim].attempts >= 2, done[victim]
    events = await history(nc, replica_run_id(run_id, victim))
    resumed = [e.step for e in events if isinstance(e, Restored) and e.step > 0]
    assert resumed and resumed[0] % H != 0, resumed  # an inner checkpoint, not a round's step
    manifests = await the_log(hub, run_id)
    assert_each_change_once(manifests, 3)
    later = [m for m in manifests if any(c.replica == victim and c.step > resumed[0]
                                         for c in m.changes)]  # fmt: skip
    assert later, "the resumed replica contributed to no round"


async def finished_or_not(nc: Client, run_id: str) -> RunRecord:
    from baton.client import calls as client

    return await client.record(nc, run_id)


async def rounds_done(hub: Stack, run_id: str, n: int) -> bool:
    return len(await the_log(hub, run_id)) >= n
