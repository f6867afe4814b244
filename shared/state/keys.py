"""Listing a KV bucket's keys: `kv.keys()`, with its false "no keys" checked.

nats-py's `keys()` watches the bucket with an ordered consumer and ends its listing when
the consumer's first info says nothing is pending and nothing has been delivered yet. A
delivery that is on its way but not yet handled when that info comes back (a machine under
load loses the race) makes it end at once and answer "no keys" — `NoKeysError` — while the
bucket holds some: the reaper then sweeps no live run, `baton runs` lists none. The race can
only cut the listing to nothing, never to part of it, so only an empty answer is checked:
against the stream's message count, and if that is not zero, by reading every key's newest
message to the end (`msg.metadata.num_pending == 0`), deletions and expiries left out.
"""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NoKeysError

DELETED = ("DEL", "PURGE")
READ_S = 5.0
"""How long one message may take to arrive once the stream said it holds some."""


async def keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every key of `bucket` that has a value now, in the stream's order."""
    kv = await js.key_value(bucket)
    try:
        return list(await kv.keys())
    except NoKeysError:
        pass
    return await read_keys(js, bucket)


async def read_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """The keys of `bucket` with a value, read message by message (what `keys` falls back
    to): an empty stream is one request; otherwise each key's newest message, once."""
    stream = f"KV_{bucket}"
    info = await js.stream_info(stream)
    if not info.state.messages:
        return []
    prefix = f"$KV.{bucket}."
    sub = await js.subscribe(
        f"{prefix}>", stream=stream, ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, headers_only=True,
    )  # fmt: skip
    found: list[str] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=READ_S)
            if not _deleted(msg):
                found.append(msg.subject.removeprefix(prefix))
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()


def _deleted(msg: Msg) -> bool:
    headers = msg.headers or {}
    return headers.get("KV-Operation") in DELETED or "Nats-Marker-Reason" in headers
