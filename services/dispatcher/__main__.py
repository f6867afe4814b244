"""`python -m services.dispatcher` — consume submissions, create runs, publish tasks: the
hub's dispatcher, or with `BATON_SITE` a site's (`site.py`)."""

from __future__ import annotations

from services.dispatcher.service import Dispatcher
from services.dispatcher.site import SiteDispatcher
from shared.bus import service

if __name__ == "__main__":
    service.main(
        "dispatcher",
        lambda nc, settings, _signals: (
            SiteDispatcher(nc, settings) if settings.site else Dispatcher(nc, settings)
        ),
    )
