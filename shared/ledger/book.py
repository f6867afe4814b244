"""The ledger's stream: writing an entry once, reading an owner's entries and balance.

Invariant: each entry is stored at most once, under the subject that names it
(`subject_of`), in a stream that keeps one message per subject and refuses a second
(`shared.bus.streams`, `_ledger`): whoever writes it, however often — a retry after a
timeout, a dispatcher or reaper restarted half way, two of them at once — the owner's
balance moves once. A hold is also a compare-and-swap on the owner's newest entry
(`Nats-Expected-Last-Subject-Sequence` over `baton.ledger.<owner>.>`), so two holds read
against one balance cannot both be taken from it.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, ServiceUnavailableError

from shared.bus import names
from shared.bus.connect import publish
from shared.bus.kvwrite import WRONG_LAST_SEQUENCE
from shared.contracts import decode, encode
from shared.contracts.ledger import Entry, Hold, Settle, TopUp
from shared.errors import ContractError

WRITTEN_ALREADY = 10077
"""JetStream's refusal of a second message on a subject the stream keeps one of — and of
any message its store failed to take (a full disk, the stream at a limit): the same code,
so an entry refused with it is written already only if it can be read back (`write`)."""
READ_S = 5.0
"""How long one entry may take to arrive once the read's consumer counted it."""
INACTIVE_S = 30.0
"""A read's consumer is removed by the server after this long unused (its reader died)."""


def subject_of(entry: Entry) -> str:
    if isinstance(entry, TopUp):
        return names.ledger_subject(entry.owner, "topup", entry.id)
    if isinstance(entry, Hold):
        return hold_subject(entry.owner, entry.run_id, entry.life, entry.n)
    return settle_subject(entry.owner, entry.run_id, entry.life)


def _of_life(run_id: str, life: int) -> str:
    """A run's life in an entry's identity: the run alone for life 0 (as entries were
    written before lives), `<run>.l<life>` after."""
    return f"{run_id}.l{life}" if life else run_id


def hold_subject(owner: str, run_id: str, life: int, n: int) -> str:
    """Hold `n` of life `life` of run `run_id`: `hold.<run>.<n>`, `hold.<run>.l<life>.<n>`."""
    return names.ledger_subject(owner, "hold", f"{_of_life(run_id, life)}.{n}")


def settle_subject(owner: str, run_id: str, life: int) -> str:
    """The settlement of life `life` of run `run_id`: `settle.<run>`, `settle.<run>.l<life>`."""
    return names.ledger_subject(owner, "settle", _of_life(run_id, life))


class Moved(Exception):
    """The owner's entries changed since the balance a hold was checked against."""


class NotStored(Exception):
    """The ledger's store refused the entry (a full disk, a limit reached): nothing was
    written, and whoever wrote it tries again later."""


async def write(js: JetStreamContext, entry: Entry, after: int | None = None) -> int | None:
    """Store `entry` once: its stream sequence, or None when it was stored before. With
    `after`, only if the owner's newest entry is still at that stream sequence (0: it has
    none), else `Moved`. `NotStored` when the store refused it: a refusal is taken for
    "written already" only once the entry is read back."""
    subject = subject_of(entry)
    headers = {}
    if after is not None:
        headers["Nats-Expected-Last-Subject-Sequence"] = str(after)
        headers["Nats-Expected-Last-Subject-Sequence-Subject"] = names.ledger_of(entry.owner)
    try:
        ack = await publish(js, subject, encode(entry), msg_id=subject, headers=headers)
    except ServiceUnavailableError as exc:
        if exc.err_code != WRITTEN_ALREADY:
            raise
        if await find(js, subject) is not None:
            return None  # the subject holds its one entry already
        raise NotStored(f"{subject}: {exc.description or exc}") from None
    except BadRequestError as exc:
        if exc.err_code in WRONG_LAST_SEQUENCE:
            if await find(js, subject) is not None:
                return None  # our own first try landed: a retry's CAS then fails
            raise Moved() from None
        raise
    return None if ack.duplicate else ack.seq


async def find(js: JetStreamContext, subject: str) -> Entry | None:
    """The entry stored under `subject`, if any (one direct get)."""
    from nats.js.errors import NotFoundError

    try:
        msg = await js.get_msg(names.LEDGER_STREAM, subject=subject, direct=True)
    except NotFoundError:
        return None
    return decode(msg.data, Entry) if msg.data else None


@dataclass
class Account:
    """An owner's entries folded: what a balance check and `baton credits` read."""

    owner: str
    balance: int = 0
    """The sum of its entries' deltas: what it may still hold for new runs."""
    holds: dict[str, int] = field(default_factory=dict)
    """Units held per run whose life is not settled yet."""
    settled: set[tuple[str, int]] = field(default_factory=set)
    """The (run, life) pairs settled: no hold is taken for them any more (`holds.Holds`)."""
    last_seq: int = 0
    """The stream sequence of its newest entry (0: none)."""
    entries: list[tuple[int, Entry]] = field(default_factory=list)
    """Every entry read, with its sequence, oldest first (kept only when asked for)."""
    unreadable: int = 0
    """Entries a newer Baton wrote that this one cannot read (left out of the sums)."""

    @property
    def held(self) -> int:
        return sum(self.holds.values())

    def fold(self, seq: int, entry: Entry, keep: bool = False) -> None:
        self.balance += entry.delta
        self.last_seq = max(self.last_seq, seq)
        if isinstance(entry, Hold):
            self.holds[entry.run_id] = self.holds.get(entry.run_id, 0) + entry.amount
        elif isinstance(entry, Settle):
            self.holds.pop(entry.run_id, None)
            self.settled.add((entry.run_id, entry.life))
        if keep:
            self.entries.append((seq, entry))


async def read(
    nc: Client, owner: str = "", after: int = 0, keep: bool = False
) -> dict[str, Account]:
    """Every owner's account (or `owner`'s alone, present even without an entry) from its
    entries after stream sequence `after`, in order, as they stand when the read begins.

    Through a consumer of its own whose filter is in its API subject — the one form a
    submitter's permissions let it use on its own entries — that counts, as it is made,
    the entries it is to deliver: the read ends with exactly those, none left behind."""
    subject = names.ledger_of(owner) if owner else names.LEDGER_ALL
    accounts: dict[str, Account] = {owner: Account(owner)} if owner else {}
    js = nc.jetstream()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    config = ConsumerConfig(
        name=f"ledger-{uuid.uuid4().hex[:16]}", filter_subject=subject, deliver_subject=inbox,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after else DeliverPolicy.ALL,
        opt_start_seq=after + 1 if after else None, ack_policy=AckPolicy.NONE,
        inactive_threshold=INACTIVE_S, mem_storage=True,
    )  # fmt: skip
    try:
        info = await js.add_consumer(names.LEDGER_STREAM, config)
        for _ in range(info.num_pending or 0):
            fold(accounts, await sub.next_msg(timeout=READ_S), keep)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await js.delete_consumer(names.LEDGER_STREAM, config.name or "")
    return accounts


async def since(nc: Client, owner: str, after: int) -> list[tuple[int, Entry]]:
    """`owner`'s entries after stream sequence `after`, in order."""
    account = (await read(nc, owner, after, keep=True))[owner]
    return account.entries


def fold(accounts: dict[str, Account], msg: Msg, keep: bool = False) -> None:
    """Add ledger message `msg` to its owner's account (the owner is its subject's third
    token, `baton.ledger.<owner>.…`); an entry this version cannot read is counted in
    `unreadable` and left out of the sums."""
    seq = msg.metadata.sequence.stream
    who = msg.subject.split(".")[2]
    account = accounts.setdefault(who, Account(who))
    try:
        entry: Entry = decode(msg.data, Entry)
    except ContractError:
        account.unreadable += 1
        account.last_seq = max(account.last_seq, seq)
        return
    account.fold(seq, entry, keep)
