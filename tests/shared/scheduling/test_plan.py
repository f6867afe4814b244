"""The scheduler's pass, without a broker: the queue's order, where runs go, who makes room
and by which rule, and that no rule can undo another's work (no cycle)."""

from __future__ import annotations

import itertools

from shared.contracts.pools import FairShare, Owner, Pool
from shared.scheduling.model import Admit, Cap, Grant, Phase, PoolState, Preempt, Run, SiteRoom
from shared.scheduling.plan import explain, plan

NOW = 1000.0
_order = itertools.count()


def queued(run_id: str, owner: str = "a", priority: int = 0, ranks: int = 1, **kw: object) -> Run:
    return Run(run_id, owner, priority, float(next(_order)), Phase.QUEUED, ranks, ranks, **kw)  # type: ignore[arg-type]


def running(
    run_id: str, owner: str = "a", priority: int = 0, ranks: int = 1, since: float = 0.0,
    **kw: object,
) -> Run:
    return Run(
        run_id, owner, priority, float(next(_order)), Phase.RUNNING, kw.pop("min_ranks", ranks),  # type: ignore[arg-type]
        kw.pop("max_ranks", ranks), ranks, running_since=since, **kw,  # type: ignore[arg-type]
    )


def state(trainers: int, *runs: Run, policy: Pool | None = None, **kw: object) -> PoolState:
    return PoolState.of("p", policy or Pool(min_run_s=0), trainers, list(runs), now=NOW, **kw)


def admitted(actions: list[object]) -> list[str]:
    return [a.run_id for a in actions if isinstance(a, Admit)]


def preempted(actions: list[object]) -> list[Preempt]:
    return [a for a in actions if isinstance(a, Preempt)]


def test_free_trainers_take_the_queue_by_priority_then_age() -> None:
    s = state(2, queued("old"), queued("urgent", priority=5), queued("new"))
    out = plan(s)
    assert admitted(out.actions) == ["urgent", "old"], out.actions
    assert "new" in out.blocked and not preempted(out.actions), out


def test_no_trainer_no_admission_and_it_says_why() -> None:
    out = plan(state(0, queued("r1")))
    assert out.actions == [] and "no trainer" in out.blocked["r1"], out


def test_a_higher_priority_run_preempts_the_lowest_with_least_unsaved_work() -> None:
    a1 = running("a1", priority=0, unsaved=30)
    a2 = running("a2", priority=0, unsaved=2)
    out = plan(state(2, a1, a2, queued("b1", owner="b", priority=10)))
    [order] = preempted(out.actions)
    assert order.run_id == "a2" and order.by == "b1" and order.kind == "priority", order
    assert admitted(out.actions) == ["b1"], out.actions


def test_equal_priority_never_preempts_and_min_run_s_protects_a_new_run() -> None:
    out = plan(state(1, running("a1"), queued("b1", owner="b")))
    assert not preempted(out.actions), out
    young = running("a1", since=NOW - 5)
    out = plan(state(1, young, queued("b1", owner="b", priority=9), policy=Pool(min_run_s=60)))
    assert not preempted(out.actions) and "b1" in out.blocked, out


def test_a_group_is_preempted_whole_or_not_at_all() -> None:
    group = running("g", ranks=2)
    out = plan(state(2, group, queued("b1", owner="b", priority=3)))
    [order] = preempted(out.actions)
    assert order.run_id == "g" and order.to_ranks == 0, order
    # Two trainers wanted, one preemptible run of one rank: nothing is preempted.
    out = plan(state(2, running("x", priority=9), running("y"), queued("z", priority=5, ranks=2)))
    assert not preempted(out.actions) and "z" in out.blocked, out


def test_an_elastic_run_shrinks_before_anyone_is_preempted_whole() -> None:
    elastic = running("e", ranks=3, min_ranks=1, max_ranks=3)
    other = running("x", unsaved=0)
    out = plan(state(4, elastic, other, queued("b1", owner="b", priority=10)))
    [order] = preempted(out.actions)
    assert order.run_id == "e" and order.to_ranks == 2, order
    assert admitted(out.actions) == ["b1"], out.actions


def test_quota_reclaims_borrowed_trainers_whatever_their_priority() -> None:
    policy = Pool(min_run_s=0, owners={"a": Owner(quota=1), "b": Owner(quota=1)})
    # a borrowed the second trainer (over its quota of 1) at a high priority.
    s = state(2, running("a1"), running("a2", priority=50), queued("b1", owner="b"),
              policy=policy)  # fmt: skip
    [order] = preempted(plan(s).actions)
    assert order.kind == "quota" and order.run_id in ("a1", "a2"), order
    # A borrower never preempts, and is listed after anyone within quota.
    s = state(2, running("a1"), running("b1", owner="b"), queued("a2", priority=50),
              policy=policy)  # fmt: skip
    out = plan(s)
    assert not preempted(out.actions) and "quota" in out.blocked["a2"], out


def test_an_idle_trainer_is_borrowed_above_quota() -> None:
    policy = Pool(min_run_s=0, owners={"a": Owner(quota=1)})
    out = plan(state(3, running("a1"), queued("a2"), policy=policy))
    assert admitted(out.actions) == ["a2"], out


def test_fair_share_reclaims_up_to_the_share_and_never_back() -> None:
    policy = Pool(
        min_run_s=0, owners={"a": Owner(weight=2)}, fair_share=FairShare(margin=0.5)
    )
    # a (weight 2) holds 3 of 4, b 1; c (weight 1) arrives: shares 2:1:1.
    s = state(4, running("a1"), running("a2"), running("a3"), running("b1", owner="b"),
              queued("c1", owner="c"), policy=policy)  # fmt: skip
    out = plan(s)
    [order] = preempted(out.actions)
    assert order.kind == "fair_share" and order.run_id.startswith("a"), order
    # Once at 2:1:1, nobody below its share less the margin: no more preemption, whoever
    # queues next.
    s = state(4, running("a1"), running("a2"), running("b1", owner="b"),
              running("c1", owner="c"), queued("a4"), queued("b2", owner="b"),
              queued("c2", owner="c"), policy=policy)  # fmt: skip
    assert not preempted(plan(s).actions)


def test_the_next_trainer_goes_to_the_owner_furthest_below_its_share() -> None:
    policy = Pool(min_run_s=0, owners={"a": Owner(weight=2)})
    # One trainer free: a holds 1 of its 2, b holds 1 of its 1.
    s = state(3, running("a1"), running("b1", owner="b"), queued("b2", owner="b"),
              queued("a2"), policy=policy)  # fmt: skip
    assert admitted(plan(s).actions) == ["a2"]
    # Equal holdings: the one that used the pool less goes first.
    s = state(1, queued("a1"), queued("b1", owner="b"), usage={"a": 100.0, "b": 10.0})
    assert admitted(plan(s).actions) == ["b1"]


def test_teams_share_the_pool_by_their_weight() -> None:
    from shared.contracts.pools import Team
    from shared.scheduling.shares import shares

    policy = Pool(
        owners={"a": Owner(team="t"), "b": Owner(team="t"), "c": Owner()},
        teams={"t": Team(weight=3)},
    )
    got = shares(policy, ["a", "b", "c"])
    assert got == {"a": 0.375, "b": 0.375, "c": 0.25}, got


def test_sites_take_what_the_hub_cannot() -> None:
    s = state(0, queued("r1", grantable=True), queued("r2", grantable=True),
              queued("r3", grantable=True, replica=True),
              sites={"lab1": SiteRoom(free=3, spare=2)})  # fmt: skip
    out = plan(s)
    grants = [a.run_id for a in out.actions if isinstance(a, Grant)]
    # One trainer free now and two runs' room ahead: r1 takes the first, r2 room ahead; a
    # replica is never granted into room ahead (it would hold every round up).
    assert grants == ["r1", "r2"] and "r3" in out.blocked, out
    out = plan(state(0, queued("r3", grantable=True, replica=True),
                     sites={"lab1": SiteRoom(free=3, spare=2)}))  # fmt: skip
    assert [a.run_id for a in out.actions if isinstance(a, Grant)] == ["r3"], out


def test_a_group_is_granted_only_where_all_its_ranks_are_free_now() -> None:
    g2, g3 = queued("g2", ranks=2, grantable=True), queued("g3", ranks=3, grantable=True)
    # lab1: two trainers free now (room 6, 4 of it ahead); lab2: three.
    rooms = {"lab1": SiteRoom(free=6, spare=4), "lab2": SiteRoom(free=3, spare=0)}
    out = plan(state(0, g3, g2, sites=rooms))
    grants = {a.run_id: a.site for a in out.actions if isinstance(a, Grant)}
    assert grants == {"g3": "lab2", "g2": "lab1"}, out.actions
    # Room ahead of need is no room for a group, and the hub's free trainers count it.
    out = plan(state(1, queued("g2", ranks=2, grantable=True),
                     sites={"lab1": SiteRoom(free=3, spare=2)}))  # fmt: skip
    assert not [a for a in out.actions if isinstance(a, Grant)] and "g2" in out.blocked, out


def test_leftover_trainers_go_to_elastic_runs() -> None:
    e = queued("e", ranks=1)
    e.max_ranks = 3
    out = plan(state(4, e))
    [admit] = [a for a in out.actions if isinstance(a, Admit)]
    assert admit.cap == 3, out.actions
    grown = running("g", ranks=1, min_ranks=1, max_ranks=4, cap=1)
    out = plan(state(3, grown))
    assert out.actions == [Cap("g", 3)], out.actions


def test_explain_orders_and_gives_reasons() -> None:
    s = state(1, running("a1"), queued("b1", owner="b"), queued("a2", priority=3))
    order, total = explain(s, lambda r: None)
    assert total == 2, total
    assert [r.run_id for r, _ in order] == ["a2", "b1"], order
    assert order[1][1] == "behind 1 run(s) of priority 3", order


def test_no_cycle_of_preemptions() -> None:
    """Carrying out every pass's decisions until nothing moves: it stops, and a run is
    preempted at most once in a pool where everyone queues at once."""
    policy = Pool(
        min_run_s=0, owners={"a": Owner(weight=2, quota=3), "b": Owner(quota=1)},
        fair_share=FairShare(margin=0.5),
    )
    runs = [running(f"a{i}", priority=i % 2) for i in range(4)]
    runs += [queued("b1", owner="b", priority=1), queued("c1", owner="c"),
             queued("c2", owner="c", priority=2)]  # fmt: skip
    preemptions: dict[str, int] = {}
    for _ in range(20):
        out = plan(state(4, *runs, policy=policy))
        moves = preempted(out.actions)
        for a in out.actions:
            r = next(r for r in runs if r.run_id == a.run_id)
            if isinstance(a, Preempt):
                preemptions[r.run_id] = preemptions.get(r.run_id, 0) + 1
                r.phase, r.ranks, r.running_since = Phase.QUEUED, 0, None
            elif isinstance(a, Admit):
                r.phase, r.ranks, r.running_since = Phase.RUNNING, a.ranks, 0.0
        if not moves and not admitted(out.actions):
            break
    else:
        raise AssertionError(f"still moving after 20 passes: {preemptions}")
    assert max(preemptions.values(), default=0) <= 1, preemptions
