"""An alert: what one notification says, whatever format a receiver wants it in.

Invariant: an alert's `key` names the one thing that happened — the event's sequence in
`BATON_EVENTS` (`e.<seq>`), or a site's cut-off episode and its status
(`s.<site>.<episode>.<status>`) — so that the same event read twice, by this notifier after
a restart or by another, makes the same key, and a receiver is told of it once (`marks.py`).
Every time an alert carries is the hub server's (its stamp of the event or of the site's
record), shown, never compared with this host's clock.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, get_args

import msgspec

from shared.contracts.alerts import SiteEpisode
from shared.contracts.records import RunRecord
from shared.errors import ContractError

Kind = Literal[
    "failed", "stalled", "budget_25", "budget_50", "budget_75", "budget_100", "guarded",
    "paused", "site_cut_off",
]  # fmt: skip
KINDS: tuple[str, ...] = get_args(Kind)
"""What the notifier tells of; a receiver may name some (`kinds`), else it gets them all."""
WARNINGS = ("stalled", "budget_25", "budget_50", "budget_75", "budget_100")
"""The `warning` events' kinds that are told; the others (`soft_timeout`) are not."""
MAX_DETAIL = 2000
"""Characters of detail a notification carries (a failure's traceback is kept by its end,
where the exception is); the whole event rides along in the JSON and Alertmanager forms."""


class Alert(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    """One of `KINDS`."""
    status: Literal["firing", "resolved"] = "firing"
    key: str
    """What happened, once (the module's invariant)."""
    summary: str
    detail: str
    event: dict[str, Any]
    """The event as JSON (for a site: its cut-off episode)."""
    at: float
    """The hub server's stamp of the event (a site's: when the cut-off was found or ended)."""
    starts_at: float
    ends_at: float | None = None
    run_id: str = ""
    pool: str = ""
    name: str = ""
    """The run's name, from its spec."""
    site: str = ""

    @property
    def fingerprint(self) -> str:
        """The same for an alert and its resolution: what it is about, not when."""
        about = f"{self.kind}|{self.run_id}|{self.site}"
        return hashlib.sha256(about.encode()).hexdigest()[:16]


def kind_of(event_type: str, payload: dict[str, Any]) -> str | None:
    """The alert an event of `event_type` makes, or None if it makes none."""
    if event_type in ("failed", "guarded", "paused"):
        return event_type
    if event_type == "warning":
        kind = payload.get("kind")
        return kind if kind in WARNINGS else None
    return None


def run_of_subject(subject: str) -> tuple[str, str]:
    """(run id, event type) of `baton.events.<run>.<type>`, a run id of one or two tokens."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[1] != "events":
        raise ContractError(f"not an event subject: {subject!r}")
    return ".".join(parts[2:-1]), parts[-1]


def payload_of(data: bytes) -> dict[str, Any]:
    """An event's JSON object. Decoded loosely — an event type may gain fields, and some
    (`guarded`, `paused`) are read only for the few fields an alert shows — but it must be
    an object."""
    try:
        payload = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ContractError(f"the event is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ContractError("the event is not a JSON object")
    return payload


def of_event(
    subject: str, payload: dict[str, Any], seq: int, stamped: float, record: RunRecord | None
) -> Alert | None:
    """The alert for one stored event (`seq`, stamped by the server at `stamped`), or None
    when it is not one that is told. `record` (the run's, if found) gives its pool and name.
    A payload naming another run than its subject is refused: the subject is what the
    servers let its publisher write."""
    run_id, event_type = run_of_subject(subject)
    kind = kind_of(event_type, payload)
    if kind is None:
        return None
    if payload.get("run_id") != run_id:
        raise ContractError(
            f"the event names run {payload.get('run_id')!r}, its subject {run_id!r}"
        )
    name = record.spec.name if record is not None else ""
    summary, detail = _words(kind, f"{name} ({run_id})" if name else run_id, payload)
    return Alert(
        kind=kind, key=f"e.{seq}", summary=summary, detail=_cut(detail), event=payload,
        at=stamped, starts_at=stamped, run_id=run_id, name=name,
        pool=record.spec.pool if record is not None else "",
    )  # fmt: skip


def _words(kind: str, run: str, p: dict[str, Any]) -> tuple[str, str]:
    """(summary, detail) of a run's alert."""
    if kind == "failed":
        reason = str(p.get("reason", ""))
        more = str(p.get("detail", ""))
        return f"Run {run} FAILED: {reason}", f"{reason}\n{more}".strip()
    if kind == "stalled":
        return f"Run {run} stalled", str(p.get("detail", ""))
    if kind.startswith("budget_"):
        share = kind.removeprefix("budget_")
        return f"Run {run} has spent {share}% of its budget", str(p.get("detail", ""))
    if kind == "guarded":
        action = p.get("action", "stop")
        return f"Run {run} stopped by a divergence guard ({action})", (
            f"at step {p.get('step')}: {p.get('metric')} = {p.get('value')} broke "
            f"{p.get('rule')}; action: {action}"
        )
    return f"Run {run} paused for a human", str(p.get("reason", ""))


def of_site(episode: SiteEpisode, status: Literal["firing", "resolved"]) -> Alert:
    """The alert that a site's cut-off began (`firing`) or ended (`resolved`)."""
    site = episode.site
    if status == "firing":
        silent = episode.noticed_at - episode.last_heard
        summary = f"Site {site} cut off: no greeting for {silent:.0f}s"
        detail = (
            f"The hub has not heard site {site} for {silent:.0f}s (threshold "
            f"{episode.cut_off_s:g}s); its trainers keep training, and what they do reaches "
            "the hub when the link is back."
        )
        at = episode.noticed_at
    else:
        assert episode.back_at is not None
        summary = f"Site {site} is back after {episode.back_at - episode.last_heard:.0f}s"
        detail = f"Site {site} greets the hub again; its outbox is being caught up."
        at = episode.back_at
    return Alert(
        kind="site_cut_off", status=status, key=f"s.{site}.{episode.episode}.{status}",
        summary=summary, detail=detail, event=msgspec.to_builtins(episode), at=at,
        starts_at=episode.last_heard, ends_at=episode.back_at if status == "resolved" else None,
        site=site,
    )  # fmt: skip


def _cut(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else "…" + text[-(MAX_DETAIL - 1) :]
