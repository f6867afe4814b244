"""`python -m services.trainer` — run training tasks of one pool.

Shutdown order on SIGTERM (preemption): the running attempt asks its child for a checkpoint,
waits for the commit (up to BATON_GRACE), releases the lease and naks the task so the next
trainer starts at once; only then does the connection drain and close, because every one of
those steps needs NATS. A second SIGTERM skips the wait; the child is killed either way.
"""

from __future__ import annotations

from services.trainer.service import Trainer
from shared.bus import service

if __name__ == "__main__":
    service.main("trainer", lambda nc, settings, signals: Trainer(nc, settings, signals))
