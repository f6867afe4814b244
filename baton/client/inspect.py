"""What the operator commands read: streams, checkpoints, dead letters, logs."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError
from nats.js.errors import NotFoundError

from baton.client import calls as client
from baton.client import reader
from baton.client.errors import CliError, needs
from shared.bus import names
from shared.checkpoint import lineage, retention
from shared.checkpoint.store import open_store
from shared.contracts import decode
from shared.contracts.letters import DeadLetter


class ConsumerReport(msgspec.Struct, frozen=True):
    name: str
    pending: int
    ack_pending: int
    redelivered: int
    waiting: int


class StreamReport(msgspec.Struct, frozen=True):
    name: str
    subjects: list[str]
    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    consumers: list[ConsumerReport]


async def streams(nc: Client, domain: str | None) -> list[StreamReport]:
    """Baton's streams and their consumers, as `nats stream report` shows them."""
    js = nc.jetstream(domain=domain)
    out = []
    for name in names.ALL_STREAMS:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            continue
        consumers = []
        for c in await js.consumers_info(name):
            consumers.append(
                ConsumerReport(
                    name=c.name or "?",
                    pending=c.num_pending or 0,
                    ack_pending=c.num_ack_pending or 0,
                    redelivered=c.num_redelivered or 0,
                    waiting=c.num_waiting or 0,
                )
            )
        state = info.state
        out.append(
            StreamReport(
                name=name,
                subjects=list(info.config.subjects or []),
                messages=state.messages,
                bytes=state.bytes,
                first_seq=state.first_seq,
                last_seq=state.last_seq,
                consumers=consumers,
            )
        )
    if not out:
        raise CliError("no Baton streams on this server (has a service started here?)", 3)
    return out


class CheckpointRow(msgspec.Struct, frozen=True):
    step: int
    token: int
    final: bool
    pinned: bool
    bytes: int
    files: list[str]
    worker: str
    created_at: float
    metrics: dict[str, float]
    status: str = "chain"
    """`chain`, `abandoned` (by a rollback) or `off` (`shared.checkpoint.lineage`)."""
    digest: str = ""
    latest: bool = False


async def checkpoints(store_url: str, run_id: str) -> list[CheckpointRow]:
    """Every checkpoint the run has stored, in the order `latest` moved through them."""
    async with open_store(store_url) as store:
        stored = await lineage.stored(store, run_id)
        pinned = await retention.pins(store, run_id)
    if not any(s.status == lineage.CHAIN for s in stored):
        raise CliError(f"run {run_id} has no committed checkpoint", 3)
    return [
        CheckpointRow(
            step=s.manifest.step,
            token=s.manifest.token,
            final=s.manifest.final,
            pinned=s.manifest.step in pinned,
            bytes=sum(f.size for f in s.manifest.files),
            files=[f.name for f in s.manifest.files],
            worker=s.manifest.worker,
            created_at=s.manifest.created_at,
            metrics=s.manifest.metrics,
            status=s.status,
            digest=s.manifest.digest,
            latest=s.latest,
        )
        for s in stored
    ]


async def pin(store_url: str, run_id: str, step: int) -> None:
    rows = await checkpoints(store_url, run_id)
    if step not in {r.step for r in rows}:
        raise CliError(f"run {run_id} has no committed checkpoint at step {step}", 3)
    async with open_store(store_url) as store:
        await retention.pin(store, run_id, step)


class Letter(msgspec.Struct, frozen=True):
    seq: int
    letter: DeadLetter


async def dlq(nc: Client) -> list[Letter]:
    js = nc.jetstream(domain=client.hub_domain(nc))
    try:
        with needs("dead-letter stream"):
            info = await js.stream_info(names.DLQ_STREAM)
    except NotFoundError:
        return []
    out = []
    # An empty stream reports first_seq 0, and there is no message 0 to ask for.
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        with contextlib.suppress(NotFoundError):
            msg = await js.get_msg(names.DLQ_STREAM, seq)
            assert msg.data is not None
            out.append(Letter(seq=seq, letter=decode(msg.data, DeadLetter)))
    return out


async def dlq_show(nc: Client, seq: int) -> Letter:
    try:
        with needs("dead-letter stream"):
            msg = await nc.jetstream(domain=client.hub_domain(nc)).get_msg(names.DLQ_STREAM, seq)
    except NotFoundError:
        raise CliError(f"no dead letter #{seq}", 3) from None
    assert msg.data is not None
    return Letter(seq=seq, letter=decode(msg.data, DeadLetter))


async def dlq_replay(nc: Client, seq: int) -> str:
    """Publish a dead letter's message again to its original subject, then remove it from
    the dead-letter stream. Returns the subject."""
    found = await dlq_show(nc, seq)
    letter = found.letter
    headers = {k: v for k, v in letter.headers.items() if not k.startswith("Nats-")}
    headers["Nats-Msg-Id"] = f"replay.{seq}.{letter.stream_seq}"
    js = nc.jetstream(domain=client.hub_domain(nc))
    await js.publish(letter.subject, letter.payload, headers=headers)
    await js.delete_msg(names.DLQ_STREAM, seq)
    return letter.subject


def payload_text(payload: bytes) -> str:
    try:
        return json.dumps(json.loads(payload), indent=2)
    except ValueError:
        return payload.decode(errors="replace")


async def log_chunks(nc: Client, run_id: str, follow: bool) -> AsyncIterator[bytes]:
    """The run's captured stdout/stderr, from the start; with `follow`, then live."""
    try:
        with needs("logs stream"):
            sub = await reader.read(
                nc, names.LOGS_STREAM, names.logs_subject(run_id), client.hub_domain(nc)
            )
    except NotFoundError:
        raise CliError(f"stream {names.LOGS_STREAM} does not exist on this server", 3) from None
    idle_deadline = time.monotonic() + 1.0
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                if not follow and time.monotonic() > idle_deadline:
                    return
                continue
            except ConnectionClosedError:
                return
            idle_deadline = time.monotonic() + 1.0
            yield msg.data
    finally:
        with contextlib.suppress(ConnectionClosedError):
            await sub.unsubscribe()


def as_json(obj: Any) -> Any:
    return json.loads(msgspec.json.encode(obj))
