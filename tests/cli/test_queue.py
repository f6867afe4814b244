"""`baton queue`: what it prints of the scheduler's answer (the waiting runs in order with
why each waits, the training runs and which make room, the owners' shares), how it refuses
a pool name that could be a wildcard, and what it says when no scheduler answers — the
formatting checked on its own, the command against a real nats-server under `baton up`'s
authorization (an operator and a submitter asking, a stand-in scheduler answering)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from rich.console import Console
from typer.testing import CliRunner

from baton.cli.app import app
from baton.cli.queue import hours, render, waited
from baton.client import scheduling
from baton.client.errors import CliError
from shared.bus import names
from shared.contracts import encode
from shared.contracts.queue import OwnerShare, QueueView, Training, Waiting
from tests.support.cli import authorized_hub, baton_as
from tests.support.roles import AuthorizedHub

REPO = Path(__file__).resolve().parents[2]

VIEW = QueueView(
    pool="default", trainers=1, free=0,
    waiting=[
        Waiting(run_id="rhigh", owner="", priority=10, position=0, state="queued", ranks=1,
                waiting="waiting for a trainer of pool 'default'", queued_s=42.0),
        Waiting(run_id="alice.rlow", owner="alice", priority=-5, position=1, state="queued",
                ranks=2, waiting="behind 1 run(s) of higher priority (up to 10)",
                queued_s=7200.0, preemptions=2),
    ],
    training=[
        Training(run_id="bob.rbusy", owner="bob", priority=0, ranks=1, worker="trainer-1",
                 leaving="for rhigh: priority 10 over 0", preemptions=1),
    ],
    owners=[
        OwnerShare(owner="", weight=1.0, team="@", share=0.5, entitled=0.5, holding=0,
                   usage_s=0.0),
        OwnerShare(owner="alice", weight=2.0, team="vision", share=0.5, entitled=0.5,
                   holding=1, usage_s=5400.0, quota=4, max_priority=10, preempted=2),
    ],
    more=3,
)  # fmt: skip


def printed(parts: list[object]) -> str:
    console = Console(width=250, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    for part in parts:
        console.print(part)
    return console.export_text()


def test_the_waiting_runs_are_listed_in_the_schedulers_order_each_with_why_it_waits() -> None:
    text = printed(render(VIEW))
    lines = text.splitlines()
    assert lines[0] == "pool default: 1 live trainer, 0 free; 5 waiting, 1 training", lines[0]
    high = next(i for i, line in enumerate(lines) if "rhigh" in line)
    low = next(i for i, line in enumerate(lines) if "alice.rlow" in line)
    assert high < low, text
    assert "waiting for a trainer of pool 'default'" in lines[high], lines[high]
    assert "operator" in lines[high] and " 42s " in lines[high], lines[high]
    assert "behind 1 run(s) of higher priority (up to 10)" in lines[low], lines[low]
    assert " 2.0h " in lines[low] and " -5 " in lines[low], lines[low]
    assert "… and 3 more waiting (--limit)" in text, text


def test_a_training_run_making_room_says_for_whom_and_owners_show_their_terms() -> None:
    text = printed(render(VIEW))
    busy = next(line for line in text.splitlines() if "bob.rbusy" in line)
    assert "trainer-1" in busy and "leaving: for rhigh: priority 10 over 0" in busy, busy
    alice = next(line for line in text.splitlines() if line.split()[1:2] == ["alice"])
    for cell in ("vision", "50.0%", "1.5", " 4 ", " 10 "):
        assert cell in alice, (cell, alice)
    operator = next(line for line in text.splitlines() if line.split()[1:2] == ["operator"])
    assert " any " in operator and " - " in operator, operator  # no team, no quota


def test_an_empty_queue_says_so() -> None:
    text = printed(render(QueueView(pool="gpu", trainers=0, free=0)))
    assert text.splitlines() == [
        "pool gpu: 0 live trainers, 0 free; 0 waiting, 0 training", "nothing waits",
        "nothing trains",
    ], text  # fmt: skip


def test_durations_and_usage_read_in_their_largest_unit() -> None:
    assert [waited(s) for s in (0.4, 59, 61, 3599, 3600, 90000)] == [
        "0s", "59s", "1m", "60m", "1.0h", "1.0d",
    ]  # fmt: skip
    assert hours(5400.0) == "1.5" and hours(36.0) == "0.01" and hours(0.0) == "0"


def test_the_schedulers_refusal_is_its_reason_and_a_bad_answer_is_one_line() -> None:
    with pytest.raises(CliError) as refused:
        scheduling.answer_of(b'{"error": "$.limit: Expected `int` >= 1"}', "gpu")
    assert refused.value.code == 2
    assert str(refused.value) == (
        "the scheduler refused the request for pool gpu: $.limit: Expected `int` >= 1"
    )
    with pytest.raises(CliError) as unreadable:
        scheduling.answer_of(b'{"pool": "gpu"}', "gpu")
    assert "cannot be read" in str(unreadable.value) and unreadable.value.code == 1
    assert scheduling.answer_of(encode(VIEW), "default") == VIEW


@pytest.mark.parametrize("pool", ["*", ">", "a.b", "", "x y", "p" * 65, "gp\u00fc"])
def test_a_pool_name_that_is_no_subject_token_is_refused_before_connecting(pool: str) -> None:
    # Nothing listens on port 1: had it tried to connect, it would have said so (exit 1).
    done = CliRunner().invoke(app, ["queue", "--pool", pool, "--server", "nats://127.0.0.1:1"])
    assert done.exit_code == 2, done.output
    assert "not a pool name" in done.output, done.output


# -- against a real nats-server -----------------------------------------------------------


@pytest_asyncio.fixture
async def hub(tmp_path: Path) -> AsyncIterator[AuthorizedHub]:
    async with authorized_hub(tmp_path) as h:
        yield h


baton = baton_as


async def test_no_scheduler_is_one_line_and_exit_1(hub: AuthorizedHub) -> None:
    code, out, err = await baton(hub, "operator", "queue", "--pool", "gpu")
    assert code == 1, (out, err)
    assert err == "error: the scheduler (the dispatcher) is not answering for pool gpu\n", err


async def test_operator_and_submitter_read_the_queue_the_scheduler_answers(
    hub: AuthorizedHub,
) -> None:
    """A stand-in scheduler (the operator, who may answer anything) answers as the
    dispatcher's does; each asker gets its answer, and the limit it asked for."""
    nc = await hub.connect("operator")
    asked: list[bytes] = []

    async def answer(msg: object) -> None:
        asked.append(msg.data)  # type: ignore[attr-defined]
        await msg.respond(encode(VIEW))  # type: ignore[attr-defined]

    await nc.subscribe(names.QUEUE_ALL, cb=answer)
    await nc.flush()
    code, out, err = await baton(hub, "submitter", "queue", "--json", "--limit", "7")
    assert code == 0, err
    assert msgspec.json.decode(out.encode(), type=QueueView) == VIEW
    assert json.loads(asked[-1]) == {"limit": 7}, asked
    code, out, err = await baton(hub, "operator", "queue")
    assert code == 0, err
    assert out.splitlines()[0] == "pool default: 1 live trainer, 0 free; 5 waiting, 1 training"
    assert "behind 1 run(s) of higher priority (up to 10)" in out, out
