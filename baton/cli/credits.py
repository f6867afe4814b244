"""`baton credits`: owners' balances in the credits ledger, what each holds for which runs,
and their entries; `baton credits topup` adds to a balance, once per top-up id.

Amounts are kept as whole units (`shared.contracts.pools.units`) and shown as credits.
"""

from __future__ import annotations

import datetime
import math
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import (
    Connection,
    Json,
    Server,
    Typer,
    app,
    call,
    fail,
    out,
    print_json,
    run,
    with_nats,
)

if TYPE_CHECKING:
    from shared.contracts.ledger import Entry
    from shared.ledger.book import Account

DEFAULT = "nats://127.0.0.1:4222"
HISTORY = 10

credits_app = Typer(
    help="Credits: balances, holds and entries (`baton credits`); top-ups (`topup`).",
    invoke_without_command=True,
)
app.add_typer(credits_app, name="credits")


@credits_app.callback(invoke_without_command=True)
def credits_command(
    ctx: typer.Context,
    owner: Annotated[
        str | None,
        typer.Option(help="Whose credits. \\[default: a submitter's own; an operator's: all]"),
    ] = None,
    history: Annotated[
        int, typer.Option(min=0, max=10_000, help="Entries to list, the newest (0: none).")
    ] = HISTORY,
    server: Server = DEFAULT,
    as_json: Json = False,
) -> None:
    """An owner's balance in credits, what it holds for which runs, and its last entries;
    without --owner, an operator sees every owner's balance and holds (one row each), a
    submitter its own (its user name is the owner)."""
    if ctx.invoked_subcommand is not None:
        return
    from baton.client import scheduling
    from shared.auth import owner_of

    user = scheduling.user_of(Connection.options())
    mine = owner_of(user)
    if owner is not None:
        run(lambda: call(scheduling.check_owner, owner))
        if mine and owner != mine:
            fail(f"{user} may read its own credits only (--owner {mine})", code=2)
    wanted = owner if owner is not None else mine
    if wanted:
        found = run(
            lambda: with_nats(server, lambda nc: scheduling.accounts(nc, wanted, keep=True))
        )
        account = found[wanted]
        if as_json:
            print_json(one_json(account, history))
        else:
            for part in one_text(account, history):
                out.print(part, soft_wrap=isinstance(part, str))
        return
    every = run(lambda: with_nats(server, scheduling.accounts))
    listed = [every[k] for k in sorted(every)]
    if as_json:
        print_json({"owners": [summary_json(a) for a in listed]})
    elif not listed:
        out.print(
            "no credits in the ledger yet (`baton credits topup OWNER AMOUNT`)", soft_wrap=True
        )
    else:
        out.print(all_table(listed))


@credits_app.command("topup")
def topup(
    owner: Annotated[str, typer.Argument(help="Whose balance: a submitter's user name.")],
    amount: Annotated[str, typer.Argument(help="Credits to add, above 0 (12, 0.5).")],
    top_up_id: Annotated[
        str | None,
        typer.Option(
            "--id",
            help="The top-up's id: the same id again is the same top-up, written once. "
            "\\[default: a fresh one]",
        ),
    ] = None,
    note: Annotated[str, typer.Option(help="Kept with the entry (why, an invoice).")] = "",
    server: Server = DEFAULT,
    as_json: Json = False,
) -> None:
    """Add credits to an owner's balance, once: a top-up written again under its id (a
    retry, a second run of a script) is the top-up already stored, and says so."""
    import uuid

    from baton.client import scheduling

    entry = run(lambda: call(make_topup, owner, amount, top_up_id or uuid.uuid4().hex, note,
                             scheduling.user_of(Connection.options())))  # fmt: skip
    written, stored, account = run(
        lambda: with_nats(server, lambda nc: scheduling.topup(nc, entry))
    )
    if as_json:
        shown = {k: v for k, v in entry_json(0, stored).items() if k != "seq"}
        print_json({"written": written, "topup": shown, **summary_json(account)})
        return
    out.print(topup_text(written, entry, stored, account), soft_wrap=True)


def make_topup(owner: str, amount: str, top_up_id: str, note: str, by: str) -> Any:
    """The `TopUp` entry asked for; `CliError` (exit 2) naming what is wrong with it, before
    anything is written."""
    from baton.client import scheduling
    from baton.client.errors import CliError
    from shared.contracts import convert
    from shared.contracts.ledger import TopUp
    from shared.contracts.pools import units
    from shared.errors import ContractError

    scheduling.check_owner(owner)
    try:
        value = float(amount)
    except ValueError:
        raise CliError(f"not an amount of credits: {amount[:40]!r} (a number above 0)", 2) from None
    if not math.isfinite(value) or value <= 0:
        raise CliError(f"the amount must be a number above 0, not {amount[:40]!r}", 2)
    amount_units = units(value)
    if amount_units < 1:
        raise CliError(f"{amount[:40]} credits is less than the ledger's unit (0.000001)", 2)
    fields = {"owner": owner, "id": top_up_id, "amount": amount_units, "by": by[:128], "note": note}
    try:
        return convert(fields, TopUp)
    except ContractError as exc:
        names = {"$.id": "--id", "$.note": "--note", "$.amount": "the amount"}
        what = names.get(exc.path, exc.path)
        raise CliError(f"{what}: {exc.reason}", 2) from None


def topup_text(written: bool, asked: Any, stored: Any, account: Account) -> str:
    from shared.contracts.pools import credits

    balance = f"{account.owner}'s balance: {credits(account.balance)} credits"
    if written:
        return f"topped up {account.owner} by {credits(asked.amount)} credits; {balance}"
    same = "" if stored.amount == asked.amount else f", not {credits(asked.amount)}"
    return (
        f"top-up {stored.id} was already written ({credits(stored.amount)} credits{same}, "
        f"at {when(stored.at)}): nothing written again; {balance}"
    )


# -- what is shown ---------------------------------------------------------------------------


def as_credits(amount: int) -> float:
    from shared.contracts.pools import UNITS_PER_CREDIT

    return amount / UNITS_PER_CREDIT


def when(at: float) -> str:
    """A writer's wall-clock time, local, to the second."""
    return datetime.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")


def described(entry: Entry) -> tuple[str, str]:
    """What an entry is about (a run, or a top-up's id) and a few words on it."""
    from shared.contracts.ledger import Hold, TopUp
    from shared.contracts.pools import credits

    if isinstance(entry, TopUp):
        said = " ".join(x for x in (f"by {entry.by}" if entry.by else "", entry.note) if x)
        return entry.id, said
    if isinstance(entry, Hold):
        return entry.run_id, entry.estimate
    return entry.run_id, f"charged {credits(entry.charged)} of {credits(entry.held)} held"


def signed(amount: int) -> str:
    from shared.contracts.pools import credits

    return credits(amount) if amount < 0 else f"+{credits(amount)}"


def entry_json(seq: int, entry: Entry) -> dict[str, Any]:
    ref, said = described(entry)
    return {
        "seq": seq, "kind": entry.kind, "ref": ref, "amount": as_credits(entry.delta),
        "amount_units": entry.delta, "at": entry.at, "detail": said,
    }  # fmt: skip


def summary_json(account: Account) -> dict[str, Any]:
    return {
        "owner": account.owner,
        "balance": as_credits(account.balance),
        "balance_units": account.balance,
        "held": as_credits(account.held),
        "held_units": account.held,
        "overdrawn": account.balance < 0,
        "holds": {run_id: as_credits(u) for run_id, u in sorted(account.holds.items())},
        "unreadable": account.unreadable,
    }


def one_json(account: Account, history: int) -> dict[str, Any]:
    kept = account.entries[-history:] if history else []
    return {**summary_json(account), "entries": [entry_json(s, e) for s, e in kept]}


def one_text(account: Account, history: int) -> list[Any]:
    """An owner's balance line, its holds and its last `history` entries."""
    from rich.markup import escape
    from rich.table import Table

    from shared.contracts.pools import credits

    runs = len(account.holds)
    parts: list[Any] = [
        f"{account.owner}: {credits(account.balance)} credits{overdrawn(account)}; "
        f"{credits(account.held)} held for {runs} run{'' if runs == 1 else 's'}"
    ]
    if account.holds:
        t = Table("run", "held")
        for run_id, amount in sorted(account.holds.items()):
            t.add_row(run_id, credits(amount))
        parts.append(t)
    if account.unreadable:
        parts.append(f"{account.unreadable} entries written by a newer Baton are left out")
    kept = account.entries[-history:] if history else []
    if kept:
        t = Table("when", "kind", "run or id", "amount", "detail")
        for _, entry in kept:
            ref, said = described(entry)
            t.add_row(when(entry.at), entry.kind, ref, signed(entry.delta), escape(said))
        parts.append(t)
    elif history and not account.entries:
        parts.append("no entries yet")
    return parts


def all_table(accounts: list[Account]) -> Any:
    from rich.table import Table

    from shared.contracts.pools import credits

    t = Table("owner", "balance", "held", "runs held")
    for a in accounts:
        t.add_row(a.owner, credits(a.balance) + overdrawn(a), credits(a.held), str(len(a.holds)))
    return t


def overdrawn(account: Account) -> str:
    """What a balance below zero says of itself: charged past what it held (a run that
    could not be held for — submitted at a cut-off site — or a pause that came late)."""
    return " (overdrawn: charged past what was held)" if account.balance < 0 else ""
