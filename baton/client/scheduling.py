"""What `baton queue`, `baton credits` and `baton pools` — and the dashboard's Queue page —
read and write over NATS, apart from how they print it: a pool's queue as the scheduler
answers for it, owners' accounts folded from the credits ledger, top-ups, and the pools'
table in force.

The ledger is read through a consumer whose filter is in its API subject
(`shared.ledger.book.read`, and `reader.read` for the dashboard's live follower): the one
form the servers' permissions let a submitter use on its own entries and the dashboard on
everyone's.
"""

from __future__ import annotations

import re
from typing import Any

from nats.aio.client import Client

from baton.client.errors import CliError, needs
from shared.bus import names
from shared.contracts import decode, encode
from shared.contracts.jobs import TOKEN
from shared.contracts.ledger import TopUp
from shared.contracts.pools import OWNER, PoolTable
from shared.contracts.queue import QueueRequest, QueueView
from shared.errors import ContractError
from shared.ledger import book
from shared.ledger.book import Account

QUEUE_TIMEOUT_S = 5.0
"""How long the scheduler has to answer for a pool's queue."""
READ_S = 5.0
"""How long one ledger entry may take to arrive while an account is read."""
_TOKEN = re.compile(TOKEN)
_OWNER = re.compile(OWNER)


class NotAnswering(CliError):
    """No scheduler answered for a pool: no dispatcher runs, or none could answer in time."""


def check_pool(pool: str) -> str:
    """`pool` if it can name a pool (a subject token: never a wildcard), else exit 2."""
    if not _TOKEN.fullmatch(pool):
        raise CliError(f"not a pool name: {pool[:100]!r} (letters, digits, _ and -)", 2)
    return pool


def check_owner(owner: str) -> str:
    """`owner` if it can name an owner (`shared.contracts.pools.OWNER`), else exit 2."""
    if not _OWNER.fullmatch(owner):
        raise CliError(
            f"not an owner: {owner[:100]!r} (a user name: 1 to 64 letters, digits, _ and -)", 2
        )
    return owner


async def queue_view(nc: Client, pool: str, limit: int = 200) -> QueueView:
    """`pool`'s queue, in the order the scheduler's next pass takes it; `NotAnswering` when
    no scheduler answered within `QUEUE_TIMEOUT_S`."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    body = encode(QueueRequest(limit=limit))
    try:
        msg = await nc.request(names.queue_subject(pool), body, timeout=QUEUE_TIMEOUT_S)
    except (NoRespondersError, NatsTimeout, TimeoutError):
        raise NotAnswering(
            f"the scheduler (the dispatcher) is not answering for pool {pool}"
        ) from None
    return answer_of(msg.data, pool)


def answer_of(data: bytes, pool: str) -> QueueView:
    """The scheduler's answer: its view of the pool, or the error it gave as a `CliError`
    (exit 2: it refused the request as asked)."""
    import json

    try:
        raw = json.loads(data)
    except ValueError:
        raw = None
    if isinstance(raw, dict) and "error" in raw:
        raise CliError(f"the scheduler refused the request for pool {pool}: {raw['error']}", 2)
    try:
        return decode(data, QueueView)
    except ContractError as exc:
        raise CliError(f"the scheduler's answer for pool {pool} cannot be read: {exc}") from None


# -- the ledger ------------------------------------------------------------------------------


fold = book.fold
"""Add a ledger message to its owner's account (`shared.ledger.book.fold`)."""


async def accounts(nc: Client, owner: str = "", keep: bool = False) -> dict[str, Account]:
    """Every owner's account, or `owner`'s alone (present even with no entry), folded from
    its entries in order as they stand now; with `keep`, each account keeps its entries."""
    with needs("ledger stream"):
        return await book.read(nc, owner, keep=keep)


async def topup(nc: Client, entry: TopUp) -> tuple[bool, TopUp, Account]:
    """Write top-up `entry` once: whether this call wrote it (False: a top-up of that id
    was stored before, and nothing was written), the top-up as stored, and the owner's
    account after it."""
    js = nc.jetstream()
    with needs("ledger stream"):
        try:
            written = await book.write(js, entry) is not None
        except book.NotStored as exc:
            why = f"the ledger did not store top-up {entry.id} ({exc}); try again"
            raise CliError(why) from None
        stored = entry if written else await book.find(js, book.subject_of(entry))
    if not isinstance(stored, TopUp):
        raise CliError(f"top-up {entry.id} of {entry.owner} was not stored; try again")
    account = (await accounts(nc, entry.owner))[entry.owner]
    return written, stored, account


# -- the pools' table ------------------------------------------------------------------------


async def table_in_force(nc: Client) -> tuple[PoolTable, int]:
    """The pools' table in force and its revision in `baton_policy` (0: none was applied;
    every service then uses its own `BATON_POOLS_FILE`, or the defaults)."""
    from shared.state.policy import Policy

    policy = Policy(nc.jetstream(), PoolTable())
    with needs("policy bucket"):
        await policy.refresh()
    return policy.table, policy.revision


async def apply_table(nc: Client, table: PoolTable) -> tuple[bool, int]:
    """Put `table` in force: whether it changed anything, and its revision."""
    from shared.state.policy import Policy

    policy = Policy(nc.jetstream(), PoolTable())
    with needs("policy bucket"):
        changed = await policy.apply(table)
    return changed, policy.revision


def user_of(options: dict[str, Any]) -> str:
    """The NATS user a client connecting with `options` logs in as — `options`' own, else
    the environment's, as `shared.bus.connect.connect` takes them ("" when a creds file or
    nothing names one)."""
    from shared import credentials

    return str({**credentials.client_options(), **options}.get("user") or "")
