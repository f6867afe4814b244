"""Reading a stack's whole history into one `History`: the only I/O of the checker.

Invariant: `collect` copies what is stored and concludes nothing — every stored message and
object it can decode is in the `History` as it was read, and each it cannot (a newer Baton's)
is counted in `unreadable` — so that whatever is wrong is found by the pure checks
(`shared.history.verify`), never hidden or invented here. It reads the hub's domain; it
writes nothing, but the ephemeral consumers that read the streams.

The reads are not one snapshot: a stack that is busy while they run may show a run between
two writes that belong together (a record terminal, its event not yet stored: the checks
pass over a record still `announce_pending`). Check a stack that is at rest, or expect what
a moment's race explains.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from shared.bus import names
from shared.checkpoint import retention
from shared.checkpoint.commit import load_manifest, read_latest
from shared.checkpoint.store import Store
from shared.contracts import decode
from shared.contracts.events import Event
from shared.contracts.ledger import Entry
from shared.errors import ContractError, NotFound
from shared.history.facts import Checkpoints, History, LeaseHeld, Logged, Posted
from shared.state import archive
from shared.state.clock import stamp
from shared.state.keys import keys
from shared.state.runs import Runs

READ_S = 5.0
"""How long one more message of a stream may take to arrive before the read counts as done;
the consumer's pending count ends it sooner."""
AT_ONCE = 8
"""Runs whose checkpoints are read at the same time."""


async def collect(nc: Client, store: Store) -> History:
    """The stack's history as stored now: its hub (through `nc`) and its store. Read in the
    order its writers write — events before records (a terminal record is written before its
    event), records before the ledger (a record is marked settled after its settlement), the
    store last (a checkpoint is committed before a record names it) — so that what one read
    implies of an earlier one holds however busy the stack."""
    js = nc.jetstream()
    unreadable = 0
    events: list[Logged] = []
    for msg in await stored(js, names.EVENTS_STREAM, names.EVENTS_ALL):
        try:
            event = decode(msg.data, Event)
        except ContractError:
            unreadable += 1
            continue
        seq = msg.metadata.sequence.stream
        events.append(Logged(seq=seq, stamp=stamp(msg.metadata.timestamp), event=event))
    runs = await Runs.open(js)
    records = {r.run_id: r for r in await runs.all()}
    archived = {r.run_id: r for r in await archive.records(js)}
    live = await runs.live_ids()
    ledger: list[Posted] = []
    for msg in await stored(js, names.LEDGER_STREAM, names.LEDGER_ALL):
        try:
            entry = decode(msg.data, Entry)
        except ContractError:
            unreadable += 1
            continue
        ledger.append(Posted(seq=msg.metadata.sequence.stream, subject=msg.subject, entry=entry))
    history = History(
        events=events, records=records, archived=archived, live=live, leases=await leases(js),
        ledger=ledger,
    )  # fmt: skip
    limit = asyncio.Semaphore(AT_ONCE)

    async def one(run_id: str) -> tuple[Checkpoints, int]:
        async with limit:
            return await checkpoints(store, run_id)

    found = await asyncio.gather(*(one(r) for r in history.run_ids()))
    return msgspec.structs.replace(
        history,
        checkpoints={c.run_id: c for c, _ in found if c.latest is not None or c.manifests},
        unreadable=unreadable + sum(n for _, n in found),
    )


async def stored(js: JetStreamContext, stream: str, subject: str) -> list[Msg]:
    """Every message of `stream` on `subject`, in stream order, as far as stored when the
    read began (none when the stream does not exist)."""
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return []
    if not info.state.messages:
        return []
    sub = await js.subscribe(
        subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    found: list[Msg] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_S)
            except TimeoutError:
                # A history cut short would show every run whose end is in its tail as
                # never ended: say so rather than check what was not read.
                raise TimeoutError(
                    f"{stream} was not read whole: {len(found)} of its messages arrived, "
                    f"then none for {READ_S:.0f}s"
                ) from None
            found.append(msg)
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()


async def leases(js: JetStreamContext) -> list[LeaseHeld]:
    """Every lease held now (an expiry marker is none)."""
    kv = await js.key_value(names.LEASES_BUCKET)
    out = []
    for key in await keys(js, names.LEASES_BUCKET):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        if not entry.value or entry.revision is None:
            continue
        try:
            held = json.loads(entry.value)
        except ValueError:
            held = {}
        worker, token = str(held.get("worker", "?")), int(held.get("token") or 0)
        out.append(LeaseHeld(key=key, worker=worker, token=token, revision=entry.revision))
    return out


async def checkpoints(store: Store, run_id: str) -> tuple[Checkpoints, int]:
    """The run's `latest`, every manifest stored and its rollback notes; and how many of
    them did not decode."""
    unreadable = 0
    try:
        current = await read_latest(store, run_id)
    except ContractError:
        current, unreadable = None, 1
    manifests = {}
    for key in await store.list(f"runs/{run_id}/manifests/"):
        try:
            manifests[key] = await load_manifest(store, key)
        except NotFound:
            continue  # garbage collection took it since the listing
        except ContractError:
            unreadable += 1
    found = Checkpoints(
        run_id=run_id, latest=current[0] if current is not None else None, manifests=manifests,
        rewinds=await retention.rewinds(store, run_id),
    )  # fmt: skip
    return found, unreadable
