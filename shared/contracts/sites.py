"""What the hub knows of its sites: their greetings, and the record it keeps of each."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

SITE_NAME = r"^[a-z0-9][a-z0-9_-]{0,31}$"
"""A site's name is also its JetStream domain and a subject token."""

SiteName = Annotated[str, Meta(pattern=SITE_NAME)]


class SiteHello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Sent on core NATS to `baton.site.<site>.hello` by the site's checkpointer, about
    once a second. Its arrival after a silence is how the hub learns the link is back."""

    site: SiteName
    outbox_last_seq: int = 0
    """The newest message in the site's outbox: what the hub has to catch up to."""
    at: float


class SiteRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One site in the hub's `baton_sites` bucket, kept by the reaper."""

    site: SiteName
    first_seen: float
    last_hello: float
    """Hub clock, when the last greeting arrived."""
    linked_at: float
    """Hub clock, when the hub's streams last (re)attached the site's outbox."""
    links: int = 1
    """How many times the link came up (the first time included)."""
    outbox_last_seq: int = 0
