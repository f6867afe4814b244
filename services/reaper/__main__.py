"""`python -m services.reaper` — sweep for runs the queue has lost."""

from __future__ import annotations

from services.reaper.service import Reaper
from shared.bus import service

if __name__ == "__main__":
    service.main("reaper", lambda nc, settings, _signals: Reaper(nc, settings))
