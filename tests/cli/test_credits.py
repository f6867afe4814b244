"""`baton credits`: a top-up's amount, owner, id and note checked before anything is
written (exit 2); a top-up written once under its id, the same id again said so; balances,
holds and entries read by each role the way its permissions allow — a submitter its own, the
operator and the dashboard everyone's — against a real nats-server under `baton up`'s
authorization, which fails the test on any request it refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from typer.testing import CliRunner

from baton.cli.app import app
from baton.cli.credits import make_topup, topup_text
from baton.client import scheduling
from baton.client.errors import CliError
from baton.ui.queue import Credits
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.ledger import book
from shared.ledger.book import Account
from tests.support.cli import authorized_hub, baton_as
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

REPO = Path(__file__).resolve().parents[2]
NOWHERE = "nats://127.0.0.1:1"
"""Nothing listens there: a command that tried to connect would say so, exit 1."""


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["alice", "0"], "above 0"),
        (["alice", "abc"], "not an amount of credits: 'abc'"),
        (["alice", "nan"], "above 0"),
        (["alice", "inf"], "above 0"),
        (["alice", "0.0000001"], "less than the ledger's unit"),
        (["alice", "1e13"], "the amount"),
        (["a.b", "5"], "not an owner: 'a.b'"),
        (["*", "5"], "not an owner"),
        (["alice", "5", "--id", "a b"], "--id"),
        (["alice", "5", "--note", "x" * 600], "--note"),
    ],
)
def test_a_bad_top_up_is_refused_before_anything_is_written(args: list[str], said: str) -> None:
    done = CliRunner().invoke(app, ["credits", "topup", *args, "--server", NOWHERE])
    assert done.exit_code == 2, done.output
    assert said in done.output, done.output


def test_a_top_up_is_made_of_whole_units() -> None:
    entry = make_topup("alice", "2.5", "t1", "invoice 7", "operator")
    assert isinstance(entry, TopUp)
    assert (entry.owner, entry.id, entry.amount, entry.by, entry.note) == (
        "alice", "t1", 2_500_000, "operator", "invoice 7",
    )  # fmt: skip
    with pytest.raises(CliError) as refused:
        make_topup("alice", "-1", "t1", "", "operator")
    assert refused.value.code == 2


def test_a_top_up_written_again_says_it_was_already_and_with_what() -> None:
    asked = make_topup("alice", "7", "t1", "", "operator")
    stored = make_topup("alice", "5", "t1", "", "operator")
    account = Account("alice", balance=5_000_000)
    said = topup_text(False, asked, stored, account)
    assert said.startswith("top-up t1 was already written (5 credits, not 7, at "), said
    assert said.endswith("nothing written again; alice's balance: 5 credits"), said
    said = topup_text(True, asked, asked, Account("alice", balance=7_000_000))
    assert said == "topped up alice by 7 credits; alice's balance: 7 credits", said


def test_a_submitter_may_not_ask_for_another_owners_credits() -> None:
    env = {"NATS_USER": "alice", "NATS_PASSWORD": "x"}
    done = CliRunner().invoke(app, ["credits", "--owner", "bob", "--server", NOWHERE], env=env)
    assert done.exit_code == 2, done.output
    assert "alice may read its own credits only (--owner alice)" in done.output, done.output


# -- against a real nats-server -----------------------------------------------------------


@pytest_asyncio.fixture
async def hub(tmp_path: Path) -> AsyncIterator[AuthorizedHub]:
    async with authorized_hub(tmp_path) as h:
        yield h


baton = baton_as


async def test_a_top_up_is_written_once_under_its_id(hub: AuthorizedHub) -> None:
    code, out, err = await baton(hub, "operator", "credits", "topup", "alice", "5", "--id", "t1")
    assert code == 0, err
    assert out == "topped up alice by 5 credits; alice's balance: 5 credits\n", out
    code, out, err = await baton(hub, "operator", "credits", "topup", "alice", "5", "--id", "t1")
    assert code == 0, err
    assert out.startswith("top-up t1 was already written (5 credits, at "), out
    code, _, err = await baton(hub, "operator", "credits", "topup", "alice", "abc")
    assert code == 2 and "not an amount" in err, err

    code, out, err = await baton(hub, "operator", "credits", "--owner", "alice", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["balance"], shown["balance_units"], shown["held"]) == (5.0, 5_000_000, 0.0)
    assert [(e["kind"], e["ref"], e["amount"]) for e in shown["entries"]] == [("topup", "t1", 5.0)]


async def test_each_role_reads_the_accounts_its_permissions_allow(hub: AuthorizedHub) -> None:
    operator = await hub.connect("operator")
    js = operator.jetstream()
    await book.write(js, TopUp(owner="submitter", id="a", amount=10_000_000))
    await book.write(js, Hold(owner="submitter", run_id="submitter.r1", n=0, amount=3_000_000))
    await book.write(js, Hold(owner="submitter", run_id="submitter.r2", n=0, amount=1_000_000))
    await book.write(js, Settle(owner="submitter", run_id="submitter.r2", held=1_000_000,
                                charged=250_000))  # fmt: skip
    await book.write(js, TopUp(owner="alice", id="b", amount=2_000_000))

    # A submitter, without --owner: its own account (its user name is the owner).
    code, out, err = await baton(hub, "submitter", "credits", "--json", "--history", "2")
    assert code == 0, err
    own = json.loads(out)
    assert own["owner"] == "submitter" and own["balance"] == 6.75, own
    assert own["holds"] == {"submitter.r1": 3.0} and own["held"] == 3.0, own
    assert [(e["kind"], e["ref"], e["amount"]) for e in own["entries"]] == [
        ("hold", "submitter.r2", -1.0), ("settle", "submitter.r2", 0.75),
    ], own["entries"]  # fmt: skip
    code, out, err = await baton(hub, "submitter", "credits")
    assert code == 0, err
    assert out.startswith("submitter: 6.75 credits; 3 held for 1 run\n"), out

    # The operator, without --owner: every owner, a row each.
    code, out, err = await baton(hub, "operator", "credits", "--json")
    assert code == 0, err
    rows = {o["owner"]: (o["balance"], o["held"]) for o in json.loads(out)["owners"]}
    assert rows == {"alice": (2.0, 0.0), "submitter": (6.75, 3.0)}, rows

    # The dashboard: every account, read once, and followed as entries are written.
    dashboard = await hub.connect("dashboard")
    every = await scheduling.accounts(dashboard)
    assert {o: a.balance for o, a in every.items()} == {"alice": 2_000_000, "submitter": 6_750_000}
    credits = Credits(dashboard)
    try:
        await credits.follow()
        assert credits.balances() == {
            "alice": {"balance": 2.0, "held": 0.0, "overdrawn": False},
            "submitter": {"balance": 6.75, "held": 3.0, "overdrawn": False},
        }  # fmt: skip
        await book.write(js, TopUp(owner="alice", id="c", amount=1_000_000))

        async def moved() -> bool:
            return credits.balances()["alice"]["balance"] == 3.0

        await eventually(moved, 10, "the dashboard's balances to follow a top-up")
        # Charged past what it held (a site's submission): overdrawn, as `baton credits` says.
        await book.write(js, Settle(owner="alice", run_id="alice.r9", held=0, charged=4_000_000))

        async def overdrawn() -> bool:
            return credits.balances()["alice"] == {
                "balance": -1.0, "held": 0.0, "overdrawn": True,
            }  # fmt: skip

        await eventually(overdrawn, 10, "the dashboard to mark the balance overdrawn")
    finally:
        await credits.stop()


async def test_an_empty_ledger_reads_at_once_as_no_account(hub: AuthorizedHub) -> None:
    code, out, err = await baton(hub, "operator", "credits")
    assert code == 0, err
    assert out == "no credits in the ledger yet (`baton credits topup OWNER AMOUNT`)\n", out
    code, out, err = await baton(hub, "submitter", "credits", "--json")
    assert code == 0, err
    assert json.loads(out)["balance"] == 0.0 and json.loads(out)["entries"] == []
