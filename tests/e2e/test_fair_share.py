"""Fair share over ten minutes, on real processes: three people weighted 2:1:1 keep runs
queued on a pool of four trainers, and get its trainer-seconds in that ratio; the third,
arriving late, holds its share within a minute (it reclaims a trainer by preemption);
every queued run starts within a stated bound and no run is preempted more than once
(docs/scheduling.md, "Fair share").

Runs are the paced regression (light: the test is about who trains when, over minutes).
Who holds how many trainers is read each second from the scheduler's own answer for the
pool (`baton queue`'s), and summed into trainer-seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.client import scheduling
from shared.contracts import RunState
from shared.contracts.events import Accepted, Started
from shared.state.runs import Runs
from tests.e2e.jobs import history, paced, submit
from tests.support.stack import Stack

pytestmark = [pytest.mark.sharing, pytest.mark.timeout(1200)]

MINUTES = 10.0
LATE_S = 60.0
"""When the third person starts submitting."""
SETTLE_S = 60.0
"""How long after the third person's arrival the shares are measured from."""
QUEUED = 2
"""Runs each person keeps waiting at any time."""
RUN_S = (20.0, 40.0)
"""How long a run trains (drawn per run)."""
PACE = 0.05
WEIGHTS = {"a": 2, "b": 1, "c": 1}
START_BOUND_S = 3 * RUN_S[1] + 30
"""The longest a queued run may wait: its owner's queue ahead of it (`QUEUED` runs) at its
owner's share of the trainers (one at least), and a margin for the stack's own pace."""
MAX_PREEMPTIONS = 1
POOLS = """
[pools.default]
min_run_s = 10
[pools.default.fair_share]
half_life_s = 300
margin = 0.5
[pools.default.owners.a]
weight = 2
"""


@pytest_asyncio.fixture
async def four(tmp_path: Path) -> AsyncIterator[Stack]:
    pools = tmp_path / "pools.toml"
    pools.write_text(POOLS)
    async with Stack(
        tmp_path / "stack", trainers=4, people=tuple(WEIGHTS),
        env={"BATON_POOLS_FILE": str(pools), "BATON_PROGRESS_INTERVAL": "1"},
    ) as s:  # fmt: skip
        yield s


class Person:
    """Keeps `QUEUED` of its runs waiting, submitting another as one starts."""

    def __init__(self, name: str, nc: Client, runs: Runs, rng: random.Random) -> None:
        self.name = name
        self.nc = nc
        self.runs = runs
        self.rng = rng
        self.submitted: list[str] = []

    async def keep_queued(self, until: float) -> None:
        while time.monotonic() < until:
            waiting = 0
            for run_id in self.submitted[-(QUEUED + 8):]:
                found = await self.runs.get(run_id)
                if found is not None and found[0].state is RunState.QUEUED:
                    waiting += 1
            for _ in range(QUEUED - waiting):
                steps = int(self.rng.uniform(*RUN_S) / PACE)
                # A checkpoint every 5 s: what the test measures is who trains when, and
                # four trainers committing every half second load the machine it shares.
                spec = paced(steps, pace=PACE, checkpoint={"every_steps": 100})
                self.submitted.append(await submit(self.nc, spec))
            await asyncio.sleep(1.0)  # a person's pace, not a synchronisation


async def test_three_people_weighted_2_1_1_share_four_trainers_over_ten_minutes(
    four: Stack,
) -> None:
    op = await four.client()
    runs = await Runs.open(op.jetstream())
    rng = random.Random(7)
    people = {n: Person(n, await four.client_as(n), runs, rng) for n in WEIGHTS}
    began = time.monotonic()
    end = began + MINUTES * 60
    holding: dict[str, list[tuple[float, int]]] = defaultdict(list)

    async def watch() -> None:
        while time.monotonic() < end:
            with contextlib.suppress(scheduling.NotAnswering):
                view = await scheduling.queue_view(op, "default")
                now = time.monotonic() - began
                for share in view.owners:
                    holding[share.owner].append((now, share.holding))
            await asyncio.sleep(1.0)  # one sample a second: an integral, not a wait

    async def late(person: Person) -> None:
        await asyncio.sleep(LATE_S)  # the person arrives then: the test's own schedule
        await person.keep_queued(end)

    await asyncio.gather(
        watch(), people["a"].keep_queued(end), people["b"].keep_queued(end), late(people["c"])
    )

    # Trainer-seconds from the third person's arrival plus a settling minute to the end.
    since = LATE_S + SETTLE_S
    used = {n: _integral(holding[n], since) for n in WEIGHTS}
    total = sum(used.values())
    shares = {n: used[n] / total for n in WEIGHTS}
    print(f"\ntrainer-seconds after {since:.0f}s: {used}; shares {shares}")
    for n, w in WEIGHTS.items():
        want = w / sum(WEIGHTS.values())
        assert abs(shares[n] - want) <= 0.05 * want, (n, shares, used)
    # The late person holds its share within a minute of its first submission.
    reached = next(t for t, n in holding["c"] if n >= 1)
    print(f"c held its trainer {reached - LATE_S:.1f}s after arriving")
    assert reached - LATE_S <= 60.0, holding["c"][:20]

    await _every_run_started_in_time(op, runs, people)
    from baton.client import calls as client

    for person in people.values():
        for run_id in person.submitted:
            with contextlib.suppress(Exception):
                await client.cancel(op, run_id, "the test is over")


async def _every_run_started_in_time(op: Client, runs: Runs, people: dict[str, Person]) -> None:
    """No queued run waited past `START_BOUND_S`, none was preempted past
    `MAX_PREEMPTIONS`."""
    waits, preemptions = [], []
    for person in people.values():
        for run_id in person.submitted:
            found = await runs.get(run_id)
            assert found is not None, run_id
            preemptions.append(found[0].preemptions)
            events = await history(op, run_id)
            accepted = next(e.at for e in events if isinstance(e, Accepted))
            started = [e.at for e in events if isinstance(e, Started)]
            if started:
                waits.append(started[0] - accepted)
            elif found[0].state is RunState.QUEUED:
                waits.append(time.time() - accepted)  # still waiting at the end
    print(f"longest wait {max(waits):.1f}s (bound {START_BOUND_S:.0f}s), "
          f"most preemptions of one run {max(preemptions)}")  # fmt: skip
    assert max(waits) <= START_BOUND_S, sorted(waits)[-5:]
    assert max(preemptions) <= MAX_PREEMPTIONS, preemptions


def _integral(samples: list[tuple[float, int]], since: float) -> float:
    """Trainer-seconds from `since` on, from one holding sample a second (each held until
    the next)."""
    out = 0.0
    for (t, n), (t2, _) in itertools.pairwise(samples):
        if t >= since:
            out += n * (t2 - t)
    return out
