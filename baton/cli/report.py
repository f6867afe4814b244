"""`baton report`: a run's history as a PNG and a self-contained HTML page, showing where it
was interrupted and how each attempt resumed. `render` is a pure function of the run record
and the events; only `collect` talks to NATS."""

from __future__ import annotations

import base64
import html
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from matplotlib.axes import Axes
from matplotlib.backend_bases import RendererBase
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import Bbox
from nats.aio.client import Client
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from baton.cli.client import CliError
from shared import names
from shared.contracts import RunRecord, decode
from shared.contracts.events import (
    AttemptFailed, Cancelled, CheckpointCommitted, CommitRefused, Completed, Event, Failed,
    Fenced, Preempted, Progress, Redispatched, Rejected, Restored, RunWarning, Started, kind_of,
)  # fmt: skip
from shared.errors import ContractError

# Attempt colours avoid the red/orange/green that mark failures, preemptions and resumes.
PALETTE = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79"]
RED, ORANGE, GREEN, GREY, AMBER = "#d62728", "#e8710a", "#2ca02c", "#555555", "#b8860b"
OUTCOME_COLOR = {
    "preempted": ORANGE, "fenced": RED, "failed": RED, "died": RED,
    "completed": GREEN, "cancelled": GREY, "running": GREY,
}  # fmt: skip
LABEL_MAX = 48


async def collect(nc: Client, run_id: str, idle_s: float = 1.0) -> list[Event]:
    """Every stored event of a run, in stream order. Stops once no event came for `idle_s`,
    or as soon as the consumer has caught up with what was stored: a live run emits
    progress faster than any idle timeout, so idleness alone might never come."""
    try:
        sub = await nc.jetstream().subscribe(
            names.events_of_run(run_id),
            stream=names.EVENTS_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
    except NotFoundError:
        raise CliError(f"stream {names.EVENTS_STREAM} does not exist on this server") from None
    found: list[Event] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except TimeoutError:
                return found
            try:
                found.append(decode(msg.data, Event))  # type: ignore[arg-type]
            except ContractError:
                pass  # an event from a newer Baton must not make the whole history unreadable
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()


@dataclass
class Attempt:
    index: int
    started: Started
    end_at: float
    outcome: str
    alive_until: float
    """Last sign of life; before `end_at` when the trainer died and its lease had to lapse."""
    end_event: Event | None = None
    resumed: Restored | None = None
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    commits: list[CheckpointCommitted] = field(default_factory=list)

    @property
    def color(self) -> str:
        return PALETTE[self.index % len(PALETTE)]

    @property
    def first_step(self) -> int:
        return self.resumed.step if self.resumed else self.started.start_step

    @property
    def last_step(self) -> int:
        return max([self.first_step, *self.steps, *(c.step for c in self.commits)])

    @property
    def name(self) -> str:
        s = self.started
        return f"attempt {s.attempt} · {s.worker} · token {s.token}"


def attempts_of(events: list[Event]) -> list[Attempt]:
    """Split the history into attempts. Attribution follows stream order, never the `at`
    clocks of different hosts; an attempt ends with its own preempted/fenced/failed event,
    the run's end, or else the next `started` (then its trainer died without a word)."""
    starts = [i for i, e in enumerate(events) if isinstance(e, Started)]
    out: list[Attempt] = []
    for n, i in enumerate(starts):
        s = events[i]
        assert isinstance(s, Started)
        nxt = next((j for j in starts if j > i), None)
        own = next((j for j in range(i + 1, len(events)) if _ends(s, events[j])), None)
        a = Attempt(n, s, s.at, "running", s.at)
        if own is not None and (nxt is None or own < nxt or isinstance(events[own], Fenced)):
            a.end_event = events[own]
            a.outcome = _outcome(events[own])
            a.end_at = events[own].at
        elif nxt is not None:
            a.outcome, a.end_at = "died", events[nxt].at
        out.append(a)
    by_token = {a.started.token: a for a in out}
    current: dict[str, Attempt] = {}
    latest: Attempt | None = None
    for i, e in enumerate(events):
        if isinstance(e, Started):
            latest = current[e.worker] = out[starts.index(i)]
            continue
        worker = getattr(e, "worker", "")
        a = current.get(worker, latest) if worker else latest
        if isinstance(e, CheckpointCommitted | CommitRefused):
            a = by_token.get(e.token, a)
        if a is None or e.at < a.started.at and not isinstance(e, Progress):
            continue
        if isinstance(e, Restored) and a.resumed is None:
            a.resumed = e
        elif isinstance(e, Progress) and "loss" in e.metrics:
            a.steps.append(e.step)
            a.losses.append(e.metrics["loss"])
        elif isinstance(e, CheckpointCommitted):
            a.commits.append(e)
        if isinstance(e, Progress | Restored | CheckpointCommitted) or e is a.end_event:
            a.alive_until = max(a.alive_until, e.at)
    for a in out:
        if a.outcome == "running":
            a.end_at = max(a.alive_until, events[-1].at)
        a.end_at = max(a.end_at, a.started.at)
    return out


def _ends(s: Started, e: Event) -> bool:
    match e:
        case Preempted() | AttemptFailed() | Started():
            return e.worker == s.worker
        case Fenced():
            return e.worker == s.worker and e.token == s.token
        case Completed() | Failed() | Cancelled():
            return True
    return False


def _outcome(e: Event) -> str:
    k = kind_of(e)
    return {"attempt_failed": "failed", "started": "died"}.get(k, k)


def render(record: RunRecord, events: list[Event], out_dir: Path) -> tuple[Path, Path]:
    """Write `<run>.png` and `<run>.html` into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, page = out_dir / f"{record.run_id}.png", out_dir / f"{record.run_id}.html"
    attempts = attempts_of(events)
    fig = Figure(figsize=(14, 9), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    loss_ax, time_ax = fig.subplots(2, 1, height_ratios=[3, 2])
    digest = f"digest {record.digest[:12]}…" if record.digest else "no digest"
    fig.suptitle(
        f"{record.run_id}  ·  {record.spec.name}  ·  {record.state.value}  ·  {digest}  ·  "
        f"{record.attempts} attempt{'s' * (record.attempts != 1)}",
        fontsize=15, fontweight="bold", parse_math=False,
    )  # fmt: skip
    _loss_axes(loss_ax, record, attempts)
    _time_axes(time_ax, attempts, events)
    fig.draw_without_rendering()  # fixes the layout, so labels can be measured where they go
    renderer = canvas.get_renderer()
    _place(loss_ax, renderer, _step_markers(record, events, attempts), (0.97, 0.89, 0.81, 0.73))
    t0 = min((e.at for e in events), default=0.0)
    unit, scale = _time_unit(events)
    marks = [
        ((e.at - t0) / scale, _short(text), color)
        for e in events
        if (text_color := _time_mark(e)) is not None
        for text, color in [text_color]
    ]
    _place(time_ax, renderer, marks, (0.97, 0.86))
    _commit_labels(time_ax, renderer, attempts, t0, scale)
    fig.savefig(png)
    image = base64.b64encode(png.read_bytes()).decode()
    page.write_text(_html(record, events, image), encoding="utf-8")
    return png, page


def _loss_axes(ax: Axes, record: RunRecord, attempts: list[Attempt]) -> None:
    total = max([record.spec.total_steps, *(a.last_step for a in attempts)])
    ax.set_xlim(0, total * 1.01)
    losses = [x for a in attempts for x in a.losses]
    for a in attempts:
        if a.steps:
            ax.plot(a.steps, a.losses, color=a.color, lw=2, label=a.name)
    # Steps computed by an attempt past where the next one resumed were thrown away.
    redone = False
    for a, b in zip(attempts, attempts[1:], strict=False):
        if b.resumed is not None and a.last_step > b.resumed.step:
            ax.axvspan(b.resumed.step, a.last_step, color=RED, alpha=0.08, lw=0)
            redone = True
    for a in attempts:
        xs = [c.step for c in a.commits]
        ax.plot(xs, [0.0] * len(xs), "|", color=a.color, ms=14, mew=2.5,
                transform=ax.get_xaxis_transform(), clip_on=False)  # fmt: skip
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], ls="", marker="|", ms=14, mew=2.5, color="k",
                          label="checkpoint committed"))  # fmt: skip
    if redone:
        handles.append(Patch(color=RED, alpha=0.15, label="steps redone after a failure"))
    ax.legend(handles=handles, loc="center right", fontsize=10, framealpha=0.9)
    if losses:
        lo, hi = min(losses), max(losses)
        if lo > 0 and hi / lo > 20:
            ax.set_yscale("log")
            ax.set_ylim(lo / 1.3, lo * (hi * 1.3 / lo) ** 1.45)  # headroom for the labels
        else:
            span = (hi - lo) or abs(hi) or 1.0
            ax.set_ylim(lo - 0.05 * span, hi + 0.5 * span)
    else:
        ax.text(0.5, 0.5, "no loss reported", transform=ax.transAxes, ha="center", color=GREY)
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("loss", fontsize=11)
    ax.grid(alpha=0.3)


def _step_markers(
    record: RunRecord, events: list[Event], attempts: list[Attempt]
) -> list[tuple[float, str, str]]:
    out: list[tuple[float, str, str]] = []
    for n, a in enumerate(attempts):
        r = a.resumed
        if r is not None and (n > 0 or r.step > 0 or r.damaged):
            skipped = f", skipped damaged {r.damaged}" if r.damaged else ""
            out.append((r.step, f"resumed @{r.step} on {r.worker}{skipped}", GREEN))
        w, step = a.started.worker, a.last_step
        match a.end_event:
            case Preempted():
                out.append((a.end_event.step, f"preempted {w} @{a.end_event.step}", ORANGE))
            case Fenced():
                out.append((step, f"fenced {w}: {a.end_event.reason}", RED))
            case AttemptFailed():
                out.append((step, f"attempt {a.started.attempt} failed: {a.end_event.reason}", RED))
        if a.outcome == "died":
            out.append((step, f"{w} died @{step}", RED))
    last = 0
    for e in events:
        match e:
            case Progress():
                last = e.step
            case Redispatched():
                out.append((last, f"redispatched: {e.reason}", GREY))
            case RunWarning():
                out.append((last, f"warning {e.kind}: {e.detail}", AMBER))
            case CommitRefused():
                out.append((e.step, f"commit refused @{e.step}", RED))
            case Completed():
                out.append((e.step, f"completed @{e.step}", GREEN))
            case Failed() | Cancelled():
                out.append((last, f"{kind_of(e)}: {e.reason}", RED))
    return [(x, _short(text), color) for x, text, color in out]


def _place(
    ax: Axes, renderer: RendererBase, items: list[tuple[float, str, str]], lanes: tuple[float, ...]
) -> None:
    """Label vertical markers in the highest lane where the label overlaps none placed yet
    (measured, not guessed); when every lane is taken the label goes to the lowest one."""
    lo, hi = ax.get_xlim()
    placed: list[Bbox] = []
    for x, text, color in sorted(items, key=lambda item: item[0]):
        frac = (x - lo) / ((hi - lo) or 1.0)
        for y in lanes:
            label = ax.text(
                x, y, text, transform=ax.get_xaxis_transform(), va="top", color=color,
                ha="left" if frac < 0.6 else "right", fontsize=10, parse_math=False, zorder=6,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": color, "alpha": 0.92},
            )  # fmt: skip
            label.set_in_layout(False)
            box = label.get_window_extent(renderer).padded(5)
            if not any(box.overlaps(p) for p in placed) or y == lanes[-1]:
                break
            label.remove()
        placed.append(box)
        ax.axvline(x, ymax=y, color=color, ls="--", lw=1.3, alpha=0.8, zorder=1)


def _time_unit(events: list[Event]) -> tuple[str, float]:
    span = max((e.at for e in events), default=0.0) - min((e.at for e in events), default=0.0)
    return ("h", 3600.0) if span > 7200 else ("min", 60.0) if span > 300 else ("s", 1.0)


def _time_axes(ax: Axes, attempts: list[Attempt], events: list[Event]) -> None:
    t0 = min((e.at for e in events), default=0.0)
    unit, scale = _time_unit(events)
    workers = list(dict.fromkeys(a.started.worker for a in attempts))
    for a in attempts:
        y = workers.index(a.started.worker)
        start, alive, end = ((t - t0) / scale for t in (a.started.at, a.alive_until, a.end_at))
        solid = alive if a.outcome == "died" else end
        ax.barh(y, solid - start, left=start, height=0.5, color=a.color, alpha=0.85)
        if a.outcome == "died":  # the lease had to lapse before anyone could take over
            ax.barh(y, end - alive, left=alive, height=0.5, color="none", ec=RED,
                    hatch="//", lw=1, alpha=0.7)  # fmt: skip
        text = f"#{a.started.attempt} tok {a.started.token} · steps {a.first_step}→{a.last_step}"
        ax.text((start + solid) / 2, y, text, ha="center", va="center", color="white",
                fontsize=9.5, fontweight="bold", clip_on=True, parse_math=False)  # fmt: skip
        marker = {"preempted": "v", "completed": "*", "running": ">"}.get(a.outcome, "X")
        at = alive if a.outcome == "died" else end
        ax.plot(at, y, marker, color=OUTCOME_COLOR[a.outcome], ms=13, mec="white", zorder=4)
        ts = [(c.at - t0) / scale for c in a.commits]
        ax.plot(ts, [y] * len(ts), "D", color="white", mec="black", ms=6, zorder=5)
    ax.set_yticks(range(len(workers)), workers, fontsize=11)
    ax.set_ylim(len(workers) - 0.4 + 0.5 * max(len(workers), 2), -0.6)  # headroom on top
    ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
    ax.set_xlabel(f"wall time since the first event ({unit})", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Line2D([], [], ls="", marker="D", color="white", mec="black", label="commit"),
        Line2D([], [], ls="", marker="v", color=ORANGE, ms=10, label="preempted"),
        Line2D([], [], ls="", marker="X", color=RED, ms=10, label="died / fenced / failed"),
        Patch(fc="none", ec=RED, hatch="//", label="waiting for the lease to lapse"),
        Line2D([], [], ls="", marker="*", color=GREEN, ms=12, label="completed"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=5,
              frameon=False, fontsize=10)  # fmt: skip


def _time_mark(e: Event) -> tuple[str, str] | None:
    match e:
        case Redispatched():
            return f"redispatched: {e.reason}", GREY
        case RunWarning():
            return f"warning {e.kind}", AMBER
        case Completed():
            return "completed", GREEN
        case Failed() | Cancelled() | Rejected():
            return f"{kind_of(e)}: {e.reason}", RED
        case _ if kind_of(e) == "accepted":
            return "accepted", GREY
    return None


def _commit_labels(
    ax: Axes, renderer: RendererBase, attempts: list[Attempt], t0: float, scale: float
) -> None:
    """Step numbers above commit markers; a number that would overlap one is left out."""
    placed: list[Bbox] = []
    for a in attempts:
        y = [t.get_text() for t in ax.get_yticklabels()].index(a.started.worker)
        for c in a.commits:
            label = ax.text((c.at - t0) / scale, y - 0.3, str(c.step), ha="center",
                            va="bottom", fontsize=8.5, color="#333333")  # fmt: skip
            box = label.get_window_extent(renderer).padded(2)
            if any(box.overlaps(p) for p in placed):
                label.remove()
            else:
                placed.append(box)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= LABEL_MAX else text[: LABEL_MAX - 1] + "…"


def describe(e: Event) -> tuple[str, str, str]:
    """(worker, step, detail) of an event, as plain text for the HTML table."""
    worker = str(getattr(e, "worker", "") or "")
    step = getattr(e, "step", None)
    match e:
        case Started():
            detail, step = f"attempt {e.attempt}, token {e.token}", e.start_step
        case Restored():
            detail = f"skipped damaged {e.damaged}" if e.damaged else "resumed"
        case CheckpointCommitted():
            detail = f"token {e.token}, {e.bytes} bytes{', final' if e.final else ''}"
        case CommitRefused():
            detail = f"token {e.token}: {e.reason}"
        case Completed():
            detail = f"digest {e.digest}"
        case Fenced():
            detail = f"token {e.token}: {e.reason}"
        case AttemptFailed():
            detail = f"attempt {e.attempt}: {e.reason} {e.detail}".strip()
        case Redispatched():
            detail = f"dispatch {e.dispatch}: {e.reason}"
        case RunWarning():
            detail = f"{e.kind}: {e.detail}"
        case Failed():
            detail = f"{e.reason} {e.detail}".strip()
        case Rejected():
            detail = f"{e.reason} (at {e.path})"
        case Cancelled():
            detail = e.reason
        case _ if kind_of(e) == "accepted":
            detail = json.dumps(msgspec.to_builtins(e))
        case _:
            detail = ""
    return worker, "" if step is None else str(step), detail


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}"


def _record_rows(record: RunRecord) -> list[tuple[str, str]]:
    data: dict[str, Any] = msgspec.to_builtins(record)
    flat = {k: v for k, v in data.items() if k != "spec"}
    flat.update({f"spec.{k}": v for k, v in data["spec"].items()})
    rows = []
    for k, v in flat.items():
        if v is None:
            text = "-"
        elif k.endswith("_at") and isinstance(v, float):
            text = f"{_utc(v)} UTC"
        else:
            text = v if isinstance(v, str) else json.dumps(v)
        rows.append((k, text))
    return rows


def _html(record: RunRecord, events: list[Event], image_b64: str) -> str:
    esc = html.escape
    t0 = min((e.at for e in events), default=0.0)
    rec = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _record_rows(record))
    rows = []
    for e in events:
        if isinstance(e, Progress):
            continue
        worker, step, detail = describe(e)
        cells = [f"{_utc(e.at)}", f"+{e.at - t0:.1f}s", kind_of(e), worker, step, detail]
        rows.append(
            f'<tr class="{esc(kind_of(e))}">' + "".join(f"<td>{esc(c)}</td>" for c in cells)
        )
    title = esc(f"{record.run_id} · {record.spec.name} · {record.state.value}")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Baton report {title}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1450px; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border-bottom: 1px solid #e5e5e5; padding: 3px 10px; text-align: left;
  vertical-align: top; }}
td {{ font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }}
tr.preempted td {{ background: #fff3e0; }} tr.completed td {{ background: #e8f5e9; }}
tr.fenced td, tr.attempt_failed td, tr.failed td, tr.commit_refused td {{ background: #fdecea; }}
</style></head><body>
<h1>{title}</h1>
<img alt="loss curve and attempt timeline of {esc(record.run_id)}"
 src="data:image/png;base64,{image_b64}">
<h2>Run record</h2>
<table>{rec}</table>
<h2>Events ({len(rows)} shown, progress omitted; times are each publisher's clock)</h2>
<table><tr><th>time (UTC)</th><th>since first</th><th>type</th><th>worker</th><th>step</th>
<th>detail</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
