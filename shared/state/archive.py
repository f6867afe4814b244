"""Ended runs' records, kept out of the live control plane.

Once a run has ended and its terminal event is stored, the reaper copies its record here
and lets the runs bucket forget it after `BATON_RETAIN_ENDED` (`Runs.retire`). The archive
is a stream with one message per run (`max_msgs_per_subject = 1`, subject
`baton.archive.<run>`): reading one run is one direct get by subject, and nothing on the
control plane's paths (sweeps, dispatch, leases) ever reads it, so its size costs them
nothing. Only `baton runs --all` walks it, once, with one ordered consumer.
"""

from __future__ import annotations

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.bus.connect import publish
from shared.contracts import RunRecord, decode, encode

IDLE_S = 0.5
"""How long `records` waits for one more message before it counts the walk as done; the
consumer's pending count ends it sooner."""


async def keep(js: JetStreamContext, record: RunRecord) -> None:
    """Store `record` as its run's archived record (replacing an earlier copy)."""
    await publish(
        js,
        names.archive_subject(record.run_id),
        encode(record),
        # The same record archived twice (a retry, two reapers) is stored once.
        msg_id=f"archive.{record.run_id}.{record.updated_at!r}",
    )


async def find(js: JetStreamContext, run_id: str) -> RunRecord | None:
    """The archived record of `run_id`, or None."""
    try:
        msg = await js.get_last_msg(
            names.ARCHIVE_STREAM, names.archive_subject(run_id), direct=True
        )
    except (NotFoundError, NoRespondersError):  # no such run; a hub without an archive
        return None
    return decode(msg.data or b"", RunRecord)


async def records(js: JetStreamContext) -> list[RunRecord]:
    """Every archived record, oldest archived first."""
    out: list[RunRecord] = []
    try:
        sub = await js.subscribe(
            names.ARCHIVE_ALL,
            stream=names.ARCHIVE_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
    except NotFoundError:
        return out
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=IDLE_S)
            except TimeoutError:
                return out
            out.append(decode(msg.data, RunRecord))
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()
