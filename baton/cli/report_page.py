"""`baton report`'s HTML page: the run's picture, its goodput, a replica's rounds, its record
and every event but progress, each string escaped (names, reasons and details are users')."""

from __future__ import annotations

import base64
import html
import json
from datetime import UTC, datetime
from typing import Any

import msgspec

from shared.contracts import RunRecord
from shared.contracts import events as ev
from shared.contracts.events import Event, kind_of
from shared.history.goodput import goodput

HEADERS = ("time (UTC)", "since first", "type", "worker", "step", "detail")


def _utc(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(" ", "milliseconds")[:23]


def _value(key: str, v: Any) -> str:
    if key.endswith("_at") and isinstance(v, float):
        return f"{_utc(v)} UTC"
    return "-" if v is None else v if isinstance(v, str) else json.dumps(v)


def _rounds(record: RunRecord, events: list[Event]) -> str:
    """A replica's outer rounds (docs/diloco.md): each round its change joined, with the
    replicas in it, who committed it, the stragglers, the bytes and its wait; each boundary
    where its change was discarded or the store out of reach."""
    if record.spec.replica is None:
        return ""
    esc, rows = html.escape, []
    for e in (e for e in events if isinstance(e, ev.Round)):
        n = e.note
        mb = f"{(n.sent_bytes + n.received_bytes) / 1e6:.3f}"
        cells = [n.step, n.outcome, n.round, n.base, ",".join(map(str, n.replicas)),
                 n.closed_by if n.outcome == "joined" else "", ",".join(map(str, n.stragglers)),
                 mb, f"{n.waited_s:.2f} s", n.detail]  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in cells) + "</tr>")
    head = ["step", "outcome", "round", "from round", "replicas", "committed by", "stragglers",
            "MB", "waited", "detail"]  # fmt: skip
    return (
        f"<h2>Rounds (replica {record.spec.replica} of {record.spec.max_replicas})</h2><table>"
        f"<tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{''.join(rows)}</table>"
    )


def html_page(record: RunRecord, events: list[Event], image: bytes) -> str:
    esc = html.escape  # every string below may carry user data: names, reasons, details
    data: dict[str, Any] = msgspec.to_builtins(record)
    data.update({f"spec.{k}": v for k, v in data.pop("spec").items()})
    rec = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(_value(k, v))}</td></tr>" for k, v in data.items()
    )
    t0, rows = min((e.at for e in events), default=0.0), []
    for e in events:
        if isinstance(e, ev.Progress):
            continue
        # `k=v` for every other field set, so an event type added later shows all it says.
        fields = msgspec.structs.asdict(e)
        worker = str(fields.pop("worker", "") or "")
        step = fields.pop("step", fields.pop("start_step", ""))
        detail = ", ".join(f"{k}={v}" for k, v in fields.items()
                           if k not in ("run_id", "at") and v not in ("", [], {}))  # fmt: skip
        cells = [_utc(e.at), f"+{e.at - t0:.1f}s", kind_of(e), worker, str(step), detail]
        tds = "".join(f"<td>{esc(c)}</td>" for c in cells)
        rows.append(f'<tr class="{esc(kind_of(e))}">{tds}</tr>')
    title = esc(f"{record.run_id} · {record.spec.name} · {record.state.value}")
    spent = goodput(events)
    shares = (
        "".join(
            f"<tr><th>{esc(c)}</th><td>{v:.2f} s</td><td>{100 * v / spent.wall_s:.1f} %</td></tr>"
            for c, v in spent.seconds().items()
        )
        if spent and spent.wall_s > 0
        else ""
    )
    summary = (
        f"<h2>Goodput {100 * spent.goodput:.1f} % of {spent.wall_s:.1f} s "
        f"({spent.steps_redone} steps redone)</h2><table>{shares}</table>"
        if spent
        else ""
    )
    summary += _rounds(record, events)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Baton report {title}</title>
<style>body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1450px; }}
img {{ max-width: 100%; border: 1px solid #ddd; }} table {{ border-collapse: collapse; }}
th, td {{ border-bottom: 1px solid #e5e5e5; padding: 3px 10px; text-align: left; }}
td {{ font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }}
.preempted {{ background: #fff3e0; }} .completed {{ background: #e8f5e9; }}
.fenced, .attempt_failed, .failed, .commit_refused, .diverged {{ background: #fdecea; }}</style>
</head><body><h1>{title}</h1>
<img alt="loss and attempts" src="data:image/png;base64,{base64.b64encode(image).decode()}">
{summary}
<h2>Run record</h2><table>{rec}</table>
<h2>Events ({len(rows)}; progress omitted; times are each publisher's own clock)</h2>
<table><tr>{"".join(f"<th>{h}</th>" for h in HEADERS)}</tr>
{chr(10).join(rows)}</table></body></html>
"""
