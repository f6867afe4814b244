"""A run's task: what puts it in its pool's work queue, published the one way every writer
(the dispatcher on a submission or a resume, the reaper for a lost run, the dispatcher for
a rollback) publishes it.

Its message id is `task.<run>.<dispatch>`: every writer of the same dispatch publishes the
same id, so the stream keeps one copy however often a crash makes one of them repeat it.
A new dispatch (`RunRecord.dispatch`) is what lets a run's task be queued again."""

from __future__ import annotations

from nats.js import JetStreamContext

from shared.bus import names
from shared.bus.connect import publish
from shared.contracts import RunRecord, Task, encode
from shared.state.lease import lease_key


async def publish_task(
    js: JetStreamContext,
    record: RunRecord,
    lease_secret: bytes | None,
    headers: dict[str, str] | None = None,
) -> None:
    """Queue `record`'s run for its pool at its current dispatch; `headers` may carry a
    trace context on to the trainers."""
    task = Task(
        run_id=record.run_id, spec=record.spec, dispatch=record.dispatch,
        lease_key=lease_key(record.run_id, lease_secret),
    )  # fmt: skip
    await publish(
        js,
        names.task_subject(record.spec.pool, record.run_id),
        encode(task),
        msg_id=f"task.{record.run_id}.{record.dispatch}",
        headers=headers,
    )
