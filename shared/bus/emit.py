"""Publishing lifecycle events."""

from __future__ import annotations

import uuid

from nats.js import JetStreamContext

from shared.bus import names
from shared.bus.connect import publish
from shared.contracts import encode
from shared.contracts.events import Event, kind_of


async def emit(
    js: JetStreamContext,
    event: Event,
    *,
    msg_id: str | None = None,
    attempts: int = 0,
    site: str = "",
) -> None:
    """Publish `event` to the run's history. Pass a `msg_id` derived from what the event is
    about (`completed.<run>`) when a retried handler could emit it twice. `attempts=0`
    retries until the event is stored — at a site (`site`), in the site's outbox, which
    stores it while the link to the hub is down."""
    kind = kind_of(event)
    await publish(
        js,
        names.at_site(names.event_subject(event.run_id, kind), site),
        encode(event),
        msg_id=msg_id or f"{kind}.{event.run_id}.{uuid.uuid4().hex}",
        attempts=attempts,
    )
