"""Credits in every corner, on real processes under `baton up`'s authorization (a priced
pool, a person of their own for each test; the stack of `test_credits.py`): a resume holds only what
the run's holds no longer cover, and a repeated one nothing; a hold that would land after
its run's settlement is refused, and one its record never took in is given back; a failed,
settled run reopened by a rollback holds for its second life (refused, nothing changed, on
a short balance) and is settled again for that life alone; a host that dies leaves what it
committed on the run's meter; a run id used again once its record is forgotten is refused
(docs/scheduling.md, "Credits").
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.client import calls as client
from shared.bus import names
from shared.checkpoint.store import open_store
from shared.contracts import RunRecord, RunState, run_id_for
from shared.contracts.control import Pause, Resume, Rollback
from shared.contracts.events import (
    AttemptFailed,
    CheckpointCommitted,
    Paused,
    Rejected,
    Reopened,
    RunWarning,
    Started,
)
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.contracts.pools import units
from shared.errors import ContractError
from shared.history.collect import collect
from shared.history.facts import Sighting
from shared.history.verify import check, describe
from shared.ledger import book
from shared.ledger.charges import charge, life_events
from shared.ledger.holds import Holds
from shared.state.runs import Runs
from tests.e2e.jobs import finished, history, job, submit
from tests.e2e.test_credits import POOLS, PRICE, _past, charlm, record
from tests.e2e.test_rollback import _letter
from tests.support.ledger import balance, balanced, priced_stack, settled, topup
from tests.support.stack import Stack, attempt_processes, eventually

pytestmark = [
    pytest.mark.sharing,
    pytest.mark.timeout(600),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """As `test_credits.py`'s: the hub's services, two trainers restarted when they die;
    a person for each test, so that each test's balance is its own."""
    people = ("alice", "bob", "carol", "dave", "erin")
    # Holds without a run are given back after 3 s here (10 minutes by default).
    env = {"BATON_VOID_AFTER": "3"}
    async with priced_stack(tmp_path_factory.mktemp("lives"), POOLS, people, env) as s:
        yield s


_dropped: list[str] = []
"""Runs a test dropped part of on purpose (a record forgotten, events gone, as retention
would): the whole day's check holds the rest to every invariant."""


def _holds(account: book.Account, run_id: str) -> list[Hold]:
    return [e for _, e in account.entries if isinstance(e, Hold) and e.run_id == run_id]


async def _paused(nc: Client, run_id: str) -> None:
    async def paused() -> bool:
        return (await record(nc, run_id)).state is RunState.PAUSED

    await eventually(paused, 120, f"{run_id} paused")


async def test_a_resume_its_holds_cover_holds_nothing_and_a_repeated_one_nothing_more(
    stack: Stack,
) -> None:
    """Paused by hand with its first hold mostly unspent and a balance of 0: the resume is
    taken, holding nothing; asked twice, the second is refused before anything is held."""
    op, alice = await stack.client(), await stack.client_as("alice")
    first = units(30 * 2.0 * PRICE)  # estimate_s 30 x margin 2 at the price
    before = await balance(op, "alice")
    assert before == 0, before
    before += await topup(op, "alice", first / units(1))
    run_id = await submit(alice, charlm("covered", 300, 0.02, name="covered", estimate_s=30))
    held = (await record(op, run_id)).holds
    assert held == [first], held
    await eventually(lambda: _past(op, run_id, 40), 120, "steps before the pause")
    await client.steer(op, Pause(run_id=run_id, reason="a look at it"))
    await _paused(op, run_id)
    assert await balance(op, "alice") == 0, "the first hold took the whole balance"

    await client.steer(alice, Resume(run_id=run_id, reason="go on"))
    await client.steer(alice, Resume(run_id=run_id, reason="go on, again"))

    async def moved_on() -> str | None:
        refused = [
            e for e in await history(op, run_id)
            if isinstance(e, RunWarning) and e.kind == "resume_refused"
        ]  # fmt: skip
        if refused:
            return refused[0].detail
        return "taken" if (await record(op, run_id)).state is not RunState.PAUSED else None

    assert await eventually(moved_on, 60, "the resume taken or refused") == "taken"
    done = await finished(op, run_id, 180)
    assert done.state is RunState.COMPLETED and done.holds == held, done
    account = (await book.read(op, "alice", keep=True))["alice"]
    assert [h.n for h in _holds(account, run_id)] == [0], "no hold beyond the first"
    await balanced(op, "alice", run_id, before, PRICE)


async def test_a_hold_after_the_settlement_is_refused_and_one_never_taken_in_given_back(
    stack: Stack,
) -> None:
    """A resume's hold that its record never took in (the resume lost its race with the
    run's end) is given back by the settlement; one that would land after the settlement
    (the dispatcher's write for a resume that read the run PAUSED before the reaper ended
    it) is refused: nothing held that nobody would give back."""
    op, bob = await stack.client(), await stack.client_as("bob")
    before = await balance(op, "bob") + await topup(op, "bob", 2.0)
    run_id = await submit(bob, charlm("late", 300, 0.02, name="late", estimate_s=20))
    await eventually(lambda: _past(op, run_id, 20), 120, "steps before the pause")
    await client.steer(op, Pause(run_id=run_id, reason="a look at it"))
    await _paused(op, run_id)
    holds = Holds(op)  # as the dispatcher takes them
    orphan = Hold(owner="bob", run_id=run_id, n=1, amount=units(0.3), estimate="lost race")
    await holds.take("bob", [orphan])  # the record never takes it in
    await client.cancel(op, run_id, "ended while a resume was on its way")
    done = await finished(op, run_id, 60)
    assert done.state is RunState.CANCELLED and done.holds == [units(0.4)], done
    settle = await balanced(op, "bob", run_id, before, PRICE)
    assert settle.held == units(0.4) + units(0.3), settle  # the orphan given back too

    late = Hold(owner="bob", run_id=run_id, n=1 + 1, amount=units(0.5), estimate="too late")
    refusal = ""
    try:
        await holds.take("bob", [late])
    except ContractError as exc:
        refusal = exc.reason
    assert "is settled" in refusal, refusal
    assert await book.find(op.jetstream(), book.subject_of(late)) is None, "written after all"
    assert await balance(op, "bob") == before - settle.charged


async def test_a_reopened_run_holds_for_its_second_life_and_is_settled_for_it_alone(
    stack: Stack, tmp_path: Path
) -> None:
    """A run whose own code failed, settled, rolled back: refused on a short balance with
    nothing changed; topped up, reopened as its second life with a hold of its own, trained
    to the end and settled again — each life charged its own trainer-seconds only."""
    op, carol = await stack.client(), await stack.client_as("carol")
    mend = tmp_path / "mend"
    before = await balance(op, "carol") + await topup(op, "carol", 0.1)
    spec = job(
        name="reopened", entry_point="tests.support.tunable:gated", total_steps=120,
        checkpoint={"every_steps": 10, "keep_last": 20}, on_failure="fail_fast",
        config={"fail_at": 35, "mend": str(mend), "pace": 0.05}, estimate_s=5,
    )  # fmt: skip
    run_id = await submit(carol, spec)
    failed = await finished(op, run_id, 120)
    assert failed.state is RunState.FAILED and failed.holds == [units(0.1)], failed
    first = await settled(op, "carol", run_id)
    assert first.held == units(0.1), first

    async def marked() -> bool:
        return (await record(op, run_id)).settled

    await eventually(marked, 60, "the first life marked settled")
    steps = [e.step for e in await history(op, run_id) if isinstance(e, CheckpointCommitted)]
    target = min(steps)

    # Short: what is left of its first hold does not pay for its steps from `target` on.
    await client.steer(op, Rollback(run_id=run_id, step=target, reason="short"))
    letter = await eventually(lambda: _letter(op, "carol's balance of"), 60, "the refusal")
    assert letter.subject == names.steer_subject(run_id), letter
    assert "carol's balance of" in letter.reason, letter
    now = await record(op, run_id)
    assert (now.state, now.life, now.settled) == (RunState.FAILED, 0, True), now
    second_hold = book.hold_subject("carol", run_id, 1, 0)
    assert await book.find(op.jetstream(), second_hold) is None, "held for a refused rollback"

    top = await topup(op, "carol", 1.0)
    mend.touch()
    await client.steer(op, Rollback(run_id=run_id, step=target, reason="mended"))
    done = await finished_life(op, run_id, 1)
    assert done.state is RunState.COMPLETED and done.life == 1, done
    opened = await book.find(op.jetstream(), second_hold)
    assert isinstance(opened, Hold) and done.holds == [opened.amount], (opened, done)

    js = op.jetstream()

    async def second() -> Settle | None:
        found = await book.find(js, book.settle_subject("carol", run_id, 1))
        return found if isinstance(found, Settle) else None

    again = await eventually(second, 90, "the second life settled")
    events = await history(op, run_id)
    assert [(e.life, e.step) for e in events if isinstance(e, Reopened)] == [(1, target)]
    for life, entry in ((0, first), (1, again)):
        spent = charge(life_events(events, life), done.price)
        assert (entry.charged, entry.productive_s) == (spent.charged, spent.productive_s), life
        assert entry.charged == units((entry.productive_s + entry.failed_s) * PRICE), entry
    assert first.failed_s > 0 and again.failed_s == 0, (first, again)
    assert again.held == opened.amount and again.life == 1, again
    account = (await book.read(op, "carol", keep=True))["carol"]
    assert account.balance == before + top - first.charged - again.charged, account.balance
    assert run_id not in account.holds, account.holds

    seen = [
        Sighting(run_id=run_id, pid=pid, alive_at=time.time())
        for name in ("t1", "t2") for pid in attempt_processes(stack.pid(name))
    ]  # fmt: skip
    async with open_store(stack.store_url) as store:
        found = msgspec.structs.replace(await collect(op, store), sightings=seen)
    assert check(found, settled_exactly=True) == [], [describe(v) for v in check(found)]


async def finished_life(nc: Client, run_id: str, life: int) -> RunRecord:
    """The run's record once it is terminal in life `life`."""

    async def ended() -> RunRecord | None:
        r = await record(nc, run_id)
        return r if r.life == life and r.state.terminal else None

    return await eventually(ended, 180, f"{run_id}'s life {life} to end")


async def test_a_host_that_dies_leaves_its_trained_seconds_on_the_meter(stack: Stack) -> None:
    """A trainer SIGKILLed well into its run's hold (a host that dies: no verdict, nothing
    booked by it) leaves what it committed on the run's meter: the next attempt pauses
    when the holds are spent in all — not after a whole hold of its own — and the run is
    charged about its holds, not half as much again."""
    op, dave = await stack.client(), await stack.client_as("dave")
    before = await balance(op, "dave") + await topup(op, "dave", 1.0)
    # Holds 10 s x 2 (the pool's margin) = 20 trainer-seconds; checkpoints every 40 steps.
    run_id = await submit(dave, charlm("host-lost", 100_000, 0.02, name="host-lost",
                                       estimate_s=10))  # fmt: skip
    held_s = (await record(op, run_id)).held / units(PRICE)

    async def well_into_it() -> bool:
        events = await history(op, run_id)
        began = [e.at for e in events if isinstance(e, Started)]
        kept = [e.at for e in events if isinstance(e, CheckpointCommitted)]
        return bool(began and kept) and kept[-1] - began[0] >= 0.6 * held_s

    await eventually(well_into_it, 120, "a commit past 60% of the run's hold")
    holder = (await record(op, run_id)).worker
    assert holder in ("t1", "t2"), holder
    stack.signal(holder, signal.SIGKILL)

    async def paused() -> Paused | None:
        found = [e for e in await history(op, run_id) if isinstance(e, Paused)]
        return found[0] if found else None

    pause = await eventually(paused, 120, "the run to pause on its credits")
    assert pause.reason.startswith("budget:"), pause
    starts = [e for e in await history(op, run_id) if isinstance(e, Started)]
    assert len(starts) == 2, starts  # the pause came in the attempt after the kill
    await client.cancel(op, run_id, "enough", "")
    settle = await balanced(op, "dave", run_id, before, PRICE)
    # On a meter that forgot the dead attempt the second one trained a whole hold of its
    # own: charged 1.6 times the hold. A pause is at the next checkpoint, so a little over.
    assert settle.charged <= 1.25 * settle.held, (settle, held_s)


async def test_a_run_id_used_again_once_its_record_is_forgotten_is_refused(stack: Stack) -> None:
    """A run settled, its record gone from the runs bucket and the archive (as the archive
    drops its oldest at its limit): a job submitted again with the same idempotency key —
    the same run id — would find its first life's hold and settlement and train free. It is
    refused, saying why; nothing is held, nothing queued."""
    op, erin = await stack.client(), await stack.client_as("erin")
    await topup(op, "erin", 1.0)
    spec = charlm("used-again", 40, 0.0, name="used-again", estimate_s=5)
    run_id = await submit(erin, spec)
    assert (await finished(op, run_id, 120)).state is RunState.COMPLETED
    await settled(op, "erin", run_id)

    async def marked() -> bool:
        return (await record(op, run_id)).settled

    await eventually(marked, 60, "the run marked settled")
    js = op.jetstream()
    await (await js.key_value(names.RUNS_BUCKET)).purge(run_id)
    await js.purge_stream(names.ARCHIVE_STREAM, subject=names.archive_subject(run_id))
    _dropped.append(run_id)
    assert await (await Runs.open(js)).find(run_id) is None
    after = await balance(op, "erin")

    # Any NATS client, the same idempotency key (a message id of its own, past the submit
    # stream's duplicate window).
    await erin.jetstream().publish(
        names.submit_subject(spec.pool, "erin"), msgspec.json.encode(spec),
        headers={"Nats-Msg-Id": "used-again-later"},
    )  # fmt: skip

    async def refused() -> Rejected | None:
        found = [e for e in await history(op, run_id) if isinstance(e, Rejected)]
        return found[-1] if found else None

    no = await eventually(refused, 60, "the submission refused")
    assert "no longer kept" in no.reason and no.path == "$.idempotency_key", no
    assert await (await Runs.open(js)).find(run_id) is None, "nothing queued"
    assert await balance(op, "erin") == after, "nothing held"
    assert await book.find(js, book.hold_subject("erin", run_id, 1, 0)) is None


async def test_a_run_whose_events_are_gone_is_charged_what_its_trainers_metered(
    stack: Stack,
) -> None:
    """A run ended while the reaper was held still, and its events dropped before it came
    back (as the events stream's retention drops the oldest): settled from what its
    trainers metered, never more than it held — not left unsettled for want of its end."""
    op, dave = await stack.client(), await stack.client_as("dave")
    await topup(op, "dave", 1.0)
    stack.signal("reaper", signal.SIGSTOP)
    try:
        run_id = await submit(dave, charlm("events-gone", 80, 0.02, name="gone", estimate_s=10))
        done = await finished(op, run_id, 120)
        assert done.state is RunState.COMPLETED and done.metered_s > 0, done
        js = op.jetstream()
        await js.purge_stream(names.EVENTS_STREAM, subject=names.events_of_run(run_id))
        _dropped.append(run_id)
        assert await history(op, run_id) == []
    finally:
        stack.signal("reaper", signal.SIGCONT)
    settle = await settled(op, "dave", run_id)
    assert settle.charged == min(settle.held, units(done.metered_s * PRICE)), (settle, done)
    assert settle.productive_s == done.metered_s and settle.charged > 0, settle


async def test_an_attempt_a_hardware_fault_killed_is_not_charged(
    stack: Stack, tmp_path: Path
) -> None:
    """The training process dies of a SIGBUS (a memory page its machine could not read
    back) once: the attempt is counted as failed and retried, marked a hardware fault, and
    the run is charged only what it kept — none of the failed attempt's seconds."""
    op, erin = await stack.client(), await stack.client_as("erin")
    before = await balance(op, "erin") + await topup(op, "erin", 1.0)
    spec = job(
        name="bus-error", entry_point="tests.support.tunable:gated", total_steps=60,
        checkpoint={"every_steps": 10}, estimate_s=10,
        config={"fail_at": 35, "by": "sigbus", "mend": str(tmp_path / "faulted"), "pace": 0.03},
    )  # fmt: skip
    run_id = await submit(erin, spec)
    done = await finished(op, run_id, 120)
    assert done.state is RunState.COMPLETED and done.attempts == 2, done
    [failed] = [e for e in await history(op, run_id) if isinstance(e, AttemptFailed)]
    assert failed.fault == "hardware", failed
    settle = await balanced(op, "erin", run_id, before, PRICE)
    assert settle.failed_s == 0, settle


async def test_holds_whose_run_was_never_recorded_are_given_back_once(stack: Stack) -> None:
    """A hold written and its run's record never (a dispatcher that died in between, its
    submission never delivered again): after a while with no record, the reaper gives it
    back — a `void` settlement, nothing charged — and the run id, used again, is refused
    rather than trained free."""
    op, carol = await stack.client(), await stack.client_as("carol")
    before = await balance(op, "carol") + await topup(op, "carol", 0.5)
    spec = charlm("never-recorded", 40, 0.0, name="never-recorded", estimate_s=5)
    run_id = run_id_for("never-recorded", "carol")
    js = op.jetstream()
    orphan = Hold(owner="carol", run_id=run_id, n=0, amount=units(0.1), estimate="by hand")
    assert await book.write(js, orphan) is not None
    assert await balance(op, "carol") == before - units(0.1)

    async def voided() -> Settle | None:
        found = await book.find(js, book.settle_subject("carol", run_id, 0))
        return found if isinstance(found, Settle) else None

    void = await eventually(voided, 60, "the orphan hold given back")
    assert (void.held, void.charged, void.state) == (units(0.1), 0, "void"), void
    assert await balance(op, "carol") == before
    _, answer = await client.submit(carol, spec, 30)
    assert isinstance(answer, Rejected) and "no longer kept" in answer.reason, answer
    assert await balance(op, "carol") == before


async def test_the_whole_day_balances_to_the_unit(stack: Stack) -> None:
    """Last, over everything this module's stack did — resumes, a reopened life, a host
    lost, a run id used again, events gone, a hardware fault, holds voided: every invariant
    of the history holds with every ended run settled (docs/verify.md), each settlement
    recomputed from its events to the unit (`charged-right`) — but of the runs a test dropped
    part of on purpose; and each owner's balance is its top-ups less its charges, no hold
    left."""
    op = await stack.client()
    async with open_store(stack.store_url) as store:
        found = await collect(op, store)
    broken = [v for v in check(found, settled_exactly=True) if set(v.runs) - set(_dropped)]
    assert broken == [], [describe(v) for v in broken]
    accounts = await book.read(op, keep=True)
    for owner in ("alice", "bob", "carol", "dave", "erin"):
        account = accounts[owner]
        entries = [e for _, e in account.entries]
        topped = sum(e.amount for e in entries if isinstance(e, TopUp))
        charged = sum(e.charged for e in entries if isinstance(e, Settle))
        assert account.balance == topped - charged and not account.holds, (owner, account)
