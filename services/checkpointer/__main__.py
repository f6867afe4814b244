"""`python -m services.checkpointer` — verify and commit checkpoints."""

from __future__ import annotations

from services.checkpointer.service import Checkpointer
from shared.bus import service

if __name__ == "__main__":
    service.main("checkpointer", lambda nc, settings, _signals: Checkpointer(nc, settings))
