"""The bodies a receiver is sent, one per format; each a pure function of the alert.

Invariant: the same alert always makes the same bytes, so a notification sent again after
a lost answer is the same notification (receivers that de-duplicate can use its `id`, or
Alertmanager's `fingerprint` with `startsAt`).

    json          {"id", "kind", "status", "run_id", "pool", "site", "summary", "detail",
                   "event", "at"}
    alertmanager  what Alertmanager's webhook receiver posts (version "4"), so anything
                  that takes Alertmanager's webhooks takes these
    slack         an incoming-webhook message, {"text": …}
"""

from __future__ import annotations

import datetime
from typing import Any, Literal, get_args

import msgspec

from services.notifier.alert import Alert

Format = Literal["json", "alertmanager", "slack"]
FORMATS: tuple[str, ...] = get_args(Format)
NEVER = "0001-01-01T00:00:00Z"
"""Alertmanager's `endsAt` of an alert that has not ended (Go's zero time)."""

_NAMES = {
    "failed": "BatonRunFailed",
    "stalled": "BatonRunStalled",
    "guarded": "BatonRunGuarded",
    "paused": "BatonRunPaused",
    "site_cut_off": "BatonSiteCutOff",
}


def body(alert: Alert, fmt: str) -> bytes:
    if fmt == "json":
        return msgspec.json.encode(as_json(alert))
    if fmt == "alertmanager":
        return msgspec.json.encode(as_alertmanager(alert))
    if fmt == "slack":
        return msgspec.json.encode(as_slack(alert))
    raise ValueError(f"no such format: {fmt!r}")


def as_json(alert: Alert) -> dict[str, Any]:
    return {
        "id": alert.key,
        "kind": alert.kind,
        "status": alert.status,
        "run_id": alert.run_id,
        "pool": alert.pool,
        "site": alert.site,
        "summary": alert.summary,
        "detail": alert.detail,
        "event": alert.event,
        "at": rfc3339(alert.at),
    }


def alertname(kind: str) -> str:
    return _NAMES.get(kind) or ("BatonRunBudget" if kind.startswith("budget_") else "Baton")


def severity(kind: str) -> str:
    return "critical" if kind in ("failed", "site_cut_off", "budget_100") else "warning"


def labels(alert: Alert) -> dict[str, str]:
    """Alertmanager's labels: what the alert is about (so its fingerprint), never when."""
    found = {
        "alertname": alertname(alert.kind),
        "severity": severity(alert.kind),
        "kind": alert.kind,
        "run_id": alert.run_id,
        "pool": alert.pool,
        "site": alert.site,
        "source": "baton",
    }
    return {k: v for k, v in found.items() if v}


def as_alertmanager(alert: Alert) -> dict[str, Any]:
    tags = labels(alert)
    notes = {"summary": alert.summary, "description": alert.detail}
    if alert.name:
        notes["run_name"] = alert.name
    return {
        "version": "4",
        "groupKey": "{}:{" + ", ".join(f'{k}="{v}"' for k, v in sorted(tags.items())) + "}",
        "truncatedAlerts": 0,
        "status": alert.status,
        "receiver": "baton",
        "groupLabels": {"alertname": tags["alertname"]},
        "commonLabels": tags,
        "commonAnnotations": notes,
        "externalURL": "",
        "alerts": [
            {
                "status": alert.status,
                "labels": tags,
                "annotations": notes,
                "startsAt": rfc3339(alert.starts_at),
                "endsAt": rfc3339(alert.ends_at) if alert.ends_at is not None else NEVER,
                "generatorURL": "",
                "fingerprint": alert.fingerprint,
            }
        ],
    }


def as_slack(alert: Alert) -> dict[str, Any]:
    """Slack's incoming webhooks read `text` as mrkdwn, in which `&`, `<` and `>` must be
    escaped (a run's name or a traceback may hold them)."""
    icon = ":white_check_mark:" if alert.status == "resolved" else _ICONS.get(alert.kind, ":bell:")
    text = f"{icon} *{_escape(alert.summary)}*"
    if alert.detail:
        text += f"\n```{_escape(alert.detail)}```"
    return {"text": text}


_ICONS = {"failed": ":x:", "site_cut_off": ":satellite_antenna:", "paused": ":pause_button:"}


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def rfc3339(at: float) -> str:
    """Seconds since the epoch as RFC 3339 in UTC, to the millisecond."""
    when = datetime.datetime.fromtimestamp(at, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
