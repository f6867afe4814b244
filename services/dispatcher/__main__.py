"""`python -m services.dispatcher` — consume submissions, create runs, publish tasks."""

from __future__ import annotations

from services.dispatcher.service import Dispatcher
from shared.bus import service

if __name__ == "__main__":
    service.main("dispatcher", lambda nc, settings, _signals: Dispatcher(nc, settings))
