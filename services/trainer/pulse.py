"""That a trainer is alive, said twice a second while it holds a run: its pulse.

The lease says who holds a run and fences everyone else; its TTL is long (10 s, 30 s on a
clustered hub) so that a blip or an election never takes a run away. The pulse says only
"alive", cheaply enough to say often: one small core-NATS message (`Pulse`) on
`baton.pulse.<worker>` every `BATON_PULSE` seconds, stored nowhere, sent only while this
trainer holds a run's lease. The reaper hands the run over when the pulse stops for
`BATON_SILENT_AFTER` seconds (`services/reaper/silences.py`), so a host that vanished costs
seconds, not the TTL. A false alarm (a trainer alive but unheard) costs compute, never
correctness: its next renewal finds the lease gone and it stops.

A trainer at a site sends none: a site keeps training through a cut of its link, and the
hub must not take its runs for a silence the cut causes (the lease decides there).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from nats.aio.client import Client

from services.trainer.attempt import Attempt
from services.trainer.rank import Member
from shared.bus import names
from shared.config import Settings
from shared.contracts import encode
from shared.contracts.control import Pulse

LOOK_S = 0.1
"""How often it looks whether an attempt took a lease: its first pulse follows within this."""


async def pulse(
    nc: Client, settings: Settings, running: Callable[[], Attempt | Member | None]
) -> None:
    """Send this trainer's pulse every `settings.pulse_s` while it holds a lease, the first
    as soon as it took one."""
    subject = names.pulse_subject(settings.worker_id)
    sent_at, sent_token = float("-inf"), 0
    while True:
        a = running()
        # A rank of another's group holds no lease: its leader pulses for the run.
        if isinstance(a, Attempt) and a.token:
            now = time.monotonic()
            if a.token != sent_token or now - sent_at >= settings.pulse_s:
                p = Pulse(worker=settings.worker_id, run_id=a.run_id, token=a.token)
                with contextlib.suppress(Exception):  # disconnected: nats-py buffers it
                    await nc.publish(subject, encode(p))
                sent_at, sent_token = now, a.token
        await asyncio.sleep(min(LOOK_S, settings.pulse_s))
