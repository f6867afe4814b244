"""A replica's course through its run's rounds (`baton.runtime.replica`), several replicas
as threads of this process on a real file store; a store out of reach is an S3 endpoint
nobody listens on."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from baton.runtime.replica import Replica
from shared.checkpoint import rounds
from shared.checkpoint.digest import weights_digest
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, Task
from shared.contracts.child import FromChild, RoundReached
from shared.contracts.records import replica_run_id
from shared.contracts.rounds import RoundNote

RUN = "rrun"
H = 5


def spec(replicas: int = 3, **outer: object) -> JobSpec:
    return msgspec.convert({
        "name": "t", "entry_point": "m:f", "total_steps": 4 * H, "replicas": replicas,
        "outer": {"inner_steps": H, "round_deadline_s": 0.5, **outer},
    }, JobSpec)  # fmt: skip


class One:
    """A replica with a linear model trained on its own random batches."""

    def __init__(self, url: str, job: JobSpec, index: int) -> None:
        self.notes: list[RoundNote] = []
        task = Task(
            run_id=replica_run_id(RUN, index), spec=msgspec.structs.replace(job, replica=index)
        )
        torch.manual_seed(index)
        self.model = torch.nn.Linear(8, 2)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.replica = Replica(task, url, self.send, None)
        self.replica.attach(self.model)
        self.gen = torch.Generator().manual_seed(100 + index)
        self.step = 0

    def send(self, msg: FromChild) -> None:
        assert isinstance(msg, RoundReached)
        if msg.note.outcome != "waiting":
            self.notes.append(msg.note)

    def train(self, steps: int, token: int = 1, *, boundaries: bool = True) -> None:
        last = self.replica.spec.total_steps
        for _ in range(steps):
            self.step += 1
            loss = self.model(torch.randn(16, 8, generator=self.gen)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if boundaries and self.replica.due(self.step, self.step == last):
                self.replica.boundary(self.step, token, self.step == last)
        if self.step == last:
            self.replica.finished(self.step)

    def weights(self) -> str:
        return weights_digest({n: p.detach() for n, p in self.model.named_parameters()})


def together(*work: tuple[One, int]) -> None:
    threads = [threading.Thread(target=one.train, args=(n,)) for one, n in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def log_of(url: str) -> list[rounds.RoundManifest]:
    async def read() -> list[rounds.RoundManifest]:
        async with open_store(url) as store:
            log = rounds.Log(store, RUN)
            await log.refresh()
            return log.manifests

    return asyncio.run(read())


def replayed(url: str, job: JobSpec) -> str:
    async def read() -> str:
        async with open_store(url) as store:
            return weights_digest((await rounds.replay(store, RUN, job.outer))[0])

    return asyncio.run(read())


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture
def nowhere(monkeypatch: pytest.MonkeyPatch) -> str:
    """An S3 store nobody answers: every call fails at once, as when a link is cut."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"BATON_S3_ENDPOINT": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
                 "AWS_SECRET_ACCESS_KEY": "x"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    return "s3://nowhere/cut"


def test_replicas_start_alike_meet_every_round_and_the_log_replays(url: str) -> None:
    # Every round closes as soon as all three are in; a deadline that a loaded machine
    # could reach between two threads' boundaries would close one without a replica.
    job = spec(round_deadline_s=60.0)
    ones = [One(url, job, i) for i in range(3)]
    assert len({o.weights() for o in ones}) == 1  # the start written once, loaded by all
    together(*((o, 4 * H) for o in ones))
    assert len({o.weights() for o in ones}) == 1
    log = log_of(url)
    assert [len(m.changes) for m in log] == [3, 3, 3, 3]
    assert replayed(url, job) == log[-1].result == ones[0].weights()
    for o in ones:
        assert [n.round for n in o.notes if n.outcome == "joined"] == [1, 2, 3, 4]


def test_a_round_closes_at_its_deadline_without_a_silent_replica(url: str) -> None:
    job = spec()
    a, b, silent = (One(url, job, i) for i in range(3))
    together((a, 2 * H), (b, 2 * H))
    log = log_of(url)
    assert [sorted(c.replica for c in m.changes) for m in log] == [[0, 1], [0, 1]]
    # The first waits for replica 2 until its deadline; the next waits only for those that
    # were in the last round, and closes as soon as both are in.
    assert [m.deadline for m in log] == [True, False]
    assert all(m.stragglers == [2] for m in log) and a.notes[-1].stragglers == [2]
    del silent


def test_a_cut_off_replica_trains_on_and_its_change_joins_late(url: str, nowhere: str) -> None:
    job = spec(max_staleness=10)
    a, b = One(url, job, 0), One(url, job, 1)
    b.replica.store_url = nowhere  # cut off after its start
    together((a, 3 * H), (b, 3 * H))  # a: three rounds alone; b: three boundaries skipped
    assert [n.outcome for n in b.notes] == ["skipped"] * 3
    assert [len(m.changes) for m in log_of(url)] == [1, 1, 1]
    b.replica.store_url = url  # healed
    together((a, H), (b, H))
    log = log_of(url)
    [mine] = [c for m in log for c in m.changes if c.replica == 1]
    assert mine.base == 0 and mine.step == 4 * H  # its 20 steps since the start, in one change
    # Each ends at the round it joined last (a may have finished a round before b's came).
    assert a.weights() == log[a.notes[-1].round - 1].result
    assert b.weights() == log[b.notes[-1].round - 1].result == log[-1].result
    assert replayed(url, job) == log[-1].result


def test_a_change_staler_than_allowed_is_discarded_with_a_note(url: str, nowhere: str) -> None:
    job = spec(max_staleness=1)
    a, b = One(url, job, 0), One(url, job, 1)
    b.replica.store_url = nowhere
    together((a, 3 * H), (b, 3 * H))
    b.replica.store_url = url
    b.train(1)  # to no boundary: it has not sent yet
    b.step = 4 * H - 1
    b.train(1)  # its last boundary: three rounds behind, more than 1
    discarded = [n for n in b.notes if n.outcome == "discarded"]
    assert discarded and "max_staleness 1" in discarded[0].detail
    assert all(c.replica == 0 for m in log_of(url) for c in m.changes)
    assert b.replica.base == 3 and b.weights() == replayed(url, job)  # caught up


def test_steps_after_a_change_a_round_took_unseen_are_sent_as_their_own(url: str) -> None:
    """Replica 1 sent its change at step 5 and lost the store before it saw round 1 take
    it; it trained on to step 10. There it finds its change in round 1 and sends what it
    did since — its weights at 5 minus its weights at 10 — instead of losing it."""
    job = spec(replicas=2)
    a, b = One(url, job, 0), One(url, job, 1)
    start = {n: t.clone() for n, t in b.replica.params.items()}
    b.train(H, boundaries=False)
    at5 = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    key = rounds.change_key(RUN, 0, 1, 1, H)
    data = rounds.encode_weights({n: start[n] - at5[n] for n in start})

    async def sent_then_lost() -> None:
        async with open_store(url) as store:
            await store.put_once(key, data)

    asyncio.run(sent_then_lost())
    b.train(H, boundaries=False)
    at10 = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    a.train(H)  # round 1: a's change and b's of step 5
    assert [c.step for c in log_of(url)[0].changes] == [H, H]
    late = threading.Thread(target=b.replica.boundary, args=(2 * H, 1, False))
    late.start()
    a.train(H)
    late.join()
    round2 = log_of(url)[1]
    rest = next(c for c in round2.changes if c.replica == 1)
    assert rest.base == 1 and rest.step == 2 * H

    async def read() -> bytes:
        async with open_store(url) as store:
            return await store.get(rest.key)

    got = rounds.decode_weights(asyncio.run(read()))
    for n in got:
        assert torch.allclose(got[n], at5[n] - at10[n], atol=1e-6)
    assert a.weights() == b.weights() == replayed(url, job)


def test_an_attempt_that_redoes_steps_already_in_a_round_only_catches_up(url: str) -> None:
    job = spec(replicas=2)
    a, b = One(url, job, 0), One(url, job, 1)
    state = b.replica.state_dict()  # as a checkpoint at step 0 holds it: copied
    saved = {k: {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v
             for k, v in state.items()}  # fmt: skip
    together((a, H), (b, H))
    assert len(log_of(url)) == 1
    again = One(url, job, 1)  # a new attempt, resumed from the checkpoint
    again.replica.load_state_dict(saved)
    again.train(H, token=2)
    assert again.notes[-1].outcome == "joined" and "earlier attempt" in again.notes[-1].detail
    assert len(log_of(url)) == 1 and again.weights() == b.weights()


def test_a_wait_cut_short_by_a_stop_loses_no_steps(url: str) -> None:
    """Asked to stop while it waits for a round, the replica notes the boundary `skipped`
    and keeps the outer state its steps began from; its change, in the store, goes into
    the round the other commits, and its next attempt's steps since go as their own."""
    job = spec(replicas=2)
    a, b = One(url, job, 0), One(url, job, 1)
    b.train(H, boundaries=False)
    b.replica.boundary(H, 1, final=False, stopping=lambda: True)
    assert [n.outcome for n in b.notes] == ["skipped"] and "asked to stop" in b.notes[0].detail
    assert b.replica.base == 0
    a.train(H)  # round 1 takes both changes
    assert sorted(c.replica for c in log_of(url)[0].changes) == [0, 1]
    late = threading.Thread(target=b.train, args=(H,))
    late.start()
    a.train(H)
    late.join()
    rest = next(c for c in log_of(url)[1].changes if c.replica == 1)
    assert rest.base == 1 and rest.step == 2 * H
    assert a.weights() == b.weights() == replayed(url, job)
