"""Whether a process's NATS connection is gone: a request on a subject only it listens on.

A server answers a request that no subscription anywhere in its cluster wants with "no
responders" (a 503 status) at once, and a process that died has no subscription left once
its server saw its socket close. A live process listens and answers nothing, so the request
times out. So a probe can say "gone" — never "alive", which only the process's own words
(a pulse, a key it renews) can say.

"Gone" is asked twice: a server loaded past its means has been seen to answer one request
"no responders" while a listener was there (tests/shared/bus/test_probe.py, under CI's
load), and a false "gone" would call a live member silent. A process that ended stays
gone, so the second answer costs one round trip and no wait.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.errors import NoRespondersError

PROBE_S = 0.25
"""How long a probe waits: a live listener lets it time out."""


async def gone(nc: Client, subject: str, timeout: float = PROBE_S) -> bool:
    """True when nobody listens on `subject` (its listener's connection is gone); False when
    someone does, or it cannot tell (not connected, a timeout, an error)."""
    for _ in range(2):
        try:
            await nc.request(subject, b"", timeout=timeout)
        except NoRespondersError:
            continue
        except Exception:
            return False
        return False
    return True
