"""The scheduler: what a decision costs at scale, and how fast fair shares converge.

    .venv/bin/python -m bench.scheduler [--queued 10000] [--trainers 1000] [--owners 50]
                                        [--reps 200] [--minutes 10] [--seed 1]

**Decision cost.** A pool of `--trainers` trainers, every one training a run, and
`--queued` runs waiting, spread over `--owners` owners with weights and a few quotas, as
the scheduler's service builds it from the records it follows (`Reckoner.state`, then
`plan`). Timed, each `--reps` times: a pass when one trainer frees (one admission: the
common decision), a pass in which a run of higher priority arrives and preempts (choosing
its victim among every running run), a pass with nothing to do, and the queue's answer
(`view_of`: every queued run in order with why it waits). Goal: under 10 ms a decision.

**Fair share.** Simulated trainers, no broker: 4 trainers, owners a, b, c weighted 2:1:1,
each keeping two runs of 30 to 60 s queued; c arrives after 60 s. Every simulated second
the scheduler's pass decides (admissions, preemptions), runs end when their time is up,
and trainer-seconds are counted per owner. Reported: each owner's share of the
trainer-seconds after c's arrival against its weight, the error, how long c took to hold
its share, the longest wait of a queued run, and the most preemptions of one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable

from services.dispatcher.queues import Reckoner, view_of
from shared import config
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.pools import FairShare, Owner, Pool
from shared.contracts.records import run_id_for
from shared.scheduling.model import Admit, Phase, Plan, PoolState, Preempt, Run
from shared.scheduling.plan import plan
from shared.scheduling.shares import Usage

SPEC = convert({"name": "b", "entry_point": "m:f", "total_steps": 100}, JobSpec)


def record(owner: str, i: int, state: RunState, priority: int = 0, worker: str = "") -> RunRecord:
    return RunRecord(
        run_id=run_id_for(f"{owner}-{i}", owner), spec=SPEC, spec_hash=spec_hash(SPEC),
        created_at=float(i), updated_at=float(i), state=state, priority=priority,
        admitted=state is not RunState.QUEUED, worker=worker or None, token=1 if worker else None,
        group_size=1 if worker else 0,
    )  # fmt: skip


def fleet(queued: int, trainers: int, owners: int, seed: int) -> tuple[Reckoner, Pool]:
    rng = random.Random(seed)
    names = [f"o{k}" for k in range(owners)]
    policy = Pool(
        min_run_s=600,  # nothing running is old enough to preempt, unless a case says so
        owners={
            n: Owner(weight=rng.choice([1, 1, 2, 4]), quota=rng.choice([None, None, 40]))
            for n in names
        },
    )
    reck = Reckoner(config.load({}))
    from shared.contracts.control import WorkerInfo

    for t in range(trainers):
        owner = names[t % owners]
        reck.observe(record(owner, t, RunState.RUNNING, worker=f"w{t}"), t + 1)
        reck.heard(WorkerInfo(worker=f"w{t}", pool="default", host="h", pid=1, device="cpu",
                              at=0.0, run_id=None))  # fmt: skip
    for q in range(queued):
        owner = names[rng.randrange(owners)]
        reck.observe(
            record(owner, trainers + q, RunState.QUEUED, priority=rng.choice([0, 0, 0, 5])),
            trainers + q + 1,
        )
    return reck, policy


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        took.append((time.perf_counter() - t0) * 1000)
    took.sort()
    return statistics.median(took), took[int(0.99 * (len(took) - 1))]


def decisions(args: argparse.Namespace) -> None:
    reck, policy = fleet(args.queued, args.trainers, args.owners, args.seed)

    def one_freed() -> object:
        state = reck.state("default", policy, set())
        state.runs = [r for r in state.runs if r.run_id != _first_running(state)]
        out = plan(state)
        assert sum(isinstance(a, Admit) for a in out.actions) == 1, out.actions[:3]
        return out

    def nothing() -> object:
        out = plan(reck.state("default", policy, set()))
        assert not out.actions, out.actions[:3]
        return out

    def preempts() -> object:
        state = reck.state("default", policy, set())
        urgent = Run("urgent", "o1", 100, -1.0, Phase.QUEUED)
        state.queued = {**state.queued, "o1": [urgent, *state.queued.get("o1", [])]}
        state.priorities = state.priorities + Counter({100: 1})
        for r in state.runs:
            if r.phase is Phase.RUNNING:
                r.running_since = -1000.0
        out = plan(state)
        assert any(isinstance(a, Preempt) for a in out.actions), out.actions[:3]
        return out

    def answer() -> object:
        return view_of(reck, "default", policy, 200)

    print(f"{args.queued} queued, {args.trainers} trainers, {args.owners} owners (ms per "
          f"pass: median, p99 over {args.reps}; decisions in the pass; ms each)")  # fmt: skip
    for name, fn in (("one trainer freed", one_freed), ("a run preempts", preempts),
                     ("nothing to do", nothing), ("the queue's answer", answer)):  # fmt: skip
        med, p99 = timed(fn, args.reps)
        made = fn()
        n = len(made.actions) if isinstance(made, Plan) else 1
        each = f"{p99 / n:7.2f}" if n else "      -"
        print(f"  {name:<20} {med:7.2f} {p99:7.2f} {n:5d} {each}")


def _first_running(state: PoolState) -> str:
    return next(r.run_id for r in state.runs if r.phase is Phase.RUNNING)


class Sim:
    """Simulated trainers under the scheduler's pass, one second at a time: an admitted run
    starts training a second later, a preempted one leaves a second later (its checkpoint)
    and is queued again with the steps it has left, a run ends when its time is up."""

    START_S = 1.0
    LEAVE_S = 1.0

    def __init__(self, trainers: int, policy: Pool, seed: int) -> None:
        self.trainers = trainers
        self.policy = policy
        self.rng = random.Random(seed)
        self.now = 0.0
        self.runs: dict[str, Run] = {}
        self.left: dict[str, float] = {}
        """Seconds of training each run still needs."""
        self.starting: dict[str, float] = {}
        self.leaving: dict[str, float] = {}
        self.usage = Usage(policy.fair_share.half_life_s)
        self.trainer_s: dict[str, float] = defaultdict(float)
        self.waits: list[float] = []
        self.queued_at: dict[str, float] = {}
        self.preempted: dict[str, int] = defaultdict(int)
        self._n = 0

    def submit(self, owner: str) -> None:
        self._n += 1
        run_id = f"{owner}.{self._n}"
        self.runs[run_id] = Run(run_id, owner, 0, self.now + self._n * 1e-6, Phase.QUEUED)
        self.left[run_id] = self.rng.uniform(30, 60)
        self.queued_at[run_id] = self.now

    def queued(self, owner: str) -> int:
        return sum(1 for r in self.runs.values() if r.owner == owner and r.phase is Phase.QUEUED)

    def step(self, dt: float = 1.0) -> None:
        self._decide()
        self.now += dt
        self._move()
        for r in list(self.runs.values()):
            if r.phase in (Phase.RUNNING, Phase.LEAVING):
                self.usage.add(r.owner, dt, self.now)
                self.trainer_s[r.owner] += dt
                if r.phase is Phase.RUNNING:
                    self.left[r.run_id] -= dt
                    if self.left[r.run_id] <= 0:
                        del self.runs[r.run_id]

    def _decide(self) -> None:
        state = PoolState.of(
            "sim", self.policy, self.trainers, list(self.runs.values()),
            usage=self.usage.values(self.now), now=self.now,
        )  # fmt: skip
        for action in plan(state).actions:
            r = self.runs[action.run_id]
            if isinstance(action, Admit):
                r.phase, r.ranks = Phase.ADMITTED, 1
                self.starting[r.run_id] = self.now + self.START_S
                self.waits.append(self.now - self.queued_at[r.run_id])
            elif isinstance(action, Preempt):
                r.phase = Phase.LEAVING
                self.leaving[r.run_id] = self.now + self.LEAVE_S
                self.preempted[r.run_id] += 1

    def _move(self) -> None:
        for run_id, at in list(self.starting.items()):
            if at <= self.now:
                r = self.runs[run_id]
                r.phase, r.running_since = Phase.RUNNING, self.now
                del self.starting[run_id]
        for run_id, at in list(self.leaving.items()):
            if at <= self.now:
                r = self.runs[run_id]
                r.phase, r.ranks, r.running_since = Phase.QUEUED, 0, None
                self.queued_at[run_id] = self.now
                del self.leaving[run_id]


def fair_share(args: argparse.Namespace) -> None:
    weights = {"a": 2, "b": 1, "c": 1}
    policy = Pool(
        min_run_s=10, owners={"a": Owner(weight=2)},
        fair_share=FairShare(half_life_s=300, margin=0.5),
    )  # fmt: skip
    sim = Sim(4, policy, args.seed)
    late, settle = 60.0, 60.0
    reached: float | None = None
    before: dict[str, float] = {}
    while sim.now < args.minutes * 60:
        for owner in weights:
            if owner == "c" and sim.now < late:
                continue
            while sim.queued(owner) < 2:
                sim.submit(owner)
        sim.step()
        holding_c = sum(1 for r in sim.runs.values() if r.owner == "c" and r.phase is Phase.RUNNING)
        if reached is None and holding_c >= 1:
            reached = sim.now - late
        if not before and sim.now >= late + settle:
            before = dict(sim.trainer_s)
    used = {o: sim.trainer_s[o] - before.get(o, 0.0) for o in weights}
    total = sum(used.values())
    print(f"fair share, simulated ({args.minutes:g} min, 4 trainers, a:b:c = 2:1:1, c from "
          f"{late:.0f}s; shares measured from {late + settle:.0f}s)")  # fmt: skip
    for o, w in weights.items():
        want = w / sum(weights.values())
        got = used[o] / total
        print(f"  {o}: {got:.3f} of the trainer-seconds (its share {want:.3f}, error "
              f"{100 * (got - want) / want:+.1f} %)")  # fmt: skip
    print(f"  c held its share {reached:.0f}s after arriving; longest wait of a queued run "
          f"{max(sim.waits):.0f}s; most preemptions of one run "
          f"{max(sim.preempted.values(), default=0)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--queued", type=int, default=10_000)
    p.add_argument("--trainers", type=int, default=1_000)
    p.add_argument("--owners", type=int, default=50)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", choices=("decisions", "fair-share"))
    args = p.parse_args()
    if args.only != "fair-share":
        decisions(args)
    if args.only != "decisions":
        fair_share(args)


if __name__ == "__main__":
    main()
