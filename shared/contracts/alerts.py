"""What the notifier keeps in its `baton_alerts` bucket (`services/notifier`)."""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.contracts.sites import SiteName


class Mark(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One notification's fate at one receiver, written once (a create) before the event
    that caused it is acked: its key (`<notification>.<receiver>`) being there is what
    keeps a redelivered event from being sent to that receiver again."""

    outcome: Literal["sent", "refused"]
    """`sent`: the receiver answered 2xx. `refused`: it answered a 4xx other than 408/429
    (or a redirect), and the notification went to the dead-letter stream instead."""
    status: int | None = None
    """The receiver's HTTP status."""
    at: float
    """The notifier's wall clock; shown, never compared."""


class SiteEpisode(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A site's latest cut-off, under key `site.<site>`: moved by compare-and-swap from
    `firing` (silent past its threshold) to `resolved` (greeting again), so that each
    cut-off is told once when it starts and once when it ends, whoever notices it."""

    site: SiteName
    episode: int
    """1 for the site's first cut-off, then one more for each."""
    status: Literal["firing", "resolved"]
    last_heard: float
    """The hub server's stamp of the site's record when the silence began: its last
    greeting before the cut."""
    noticed_at: float
    """The hub server's clock when the silence was found longer than the threshold."""
    back_at: float | None = None
    """The hub server's stamp of the first greeting after the cut, once resolved."""
    cut_off_s: float
    """The threshold the silence was measured against."""
