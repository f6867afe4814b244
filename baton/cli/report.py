"""`baton report`: where a run was interrupted and how each attempt resumed, as a PNG and an
HTML page (`report_page`). `render` is a pure function of the record and the events;
`collect` reads NATS."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backend_bases import RendererBase
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.transforms import Bbox
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from baton.cli.report_page import html_page
from baton.client import reader
from baton.client.errors import CliError
from shared.bus import names
from shared.contracts import RunRecord, decode
from shared.contracts import events as ev
from shared.contracts.events import Event, kind_of
from shared.errors import ContractError
from shared.history.clocks import from_messages
from shared.history.goodput import goodput
from shared.history.timeline import Attempt, attempts_of

# Attempt colours avoid the red/orange/green that mark failures, preemptions and resumes.
PALETTE = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79"]
RED, ORANGE, GREEN, GREY, AMBER = "#d62728", "#e8710a", "#2ca02c", "#555555", "#b8860b"
END_MARKER = {"preempted": ("v", ORANGE), "completed": ("*", GREEN), "running": (">", GREY),
              "cancelled": ("X", GREY), "rank_lost": ("v", RED)}  # fmt: skip
Marks = list[tuple[float, str, str]]  # (x, label, colour)


async def collect(nc: Client, run_id: str, idle_s: float = 1.0) -> list[Event]:
    """Every stored event of a run, in stream order, each `at` as its publisher's clock
    wrote it. What `baton report` draws and subtracts is `on_hub_clock`'s. An event from a
    newer Baton is left out rather than making the whole history unreadable."""
    found = []
    for msg in await stored(nc, run_id, idle_s):
        with contextlib.suppress(ContractError):
            found.append(decode(msg.data, Event))
    return found


async def on_hub_clock(nc: Client, run_id: str, idle_s: float = 1.0) -> list[Event]:
    """As `collect`, each `at` on the hub's clock (`shared.history.clocks`): the run's
    events come from hosts whose clocks may differ by minutes."""
    return from_messages(await stored(nc, run_id, idle_s))


async def stored(nc: Client, run_id: str, idle_s: float) -> list[Msg]:
    """The stored messages of a run's events, in stream order. Stops once no event came for
    `idle_s`, or as soon as the consumer has caught up with what was stored: a live run
    emits progress faster than any idle timeout, so idleness alone might never come."""
    try:
        sub = await reader.read(nc, names.EVENTS_STREAM, names.events_of_run(run_id))
    except NotFoundError:
        raise CliError(f"stream {names.EVENTS_STREAM} does not exist on this server") from None
    found: list[Msg] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except TimeoutError:
                break
            found.append(msg)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return found


def _color(a: Attempt) -> str:
    return PALETTE[a.index % len(PALETTE)]


def render(record: RunRecord, events: list[Event], out_dir: Path) -> tuple[Path, Path]:
    """Write `<run>.png` and `<run>.html` into `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, page = out_dir / f"{record.run_id}.png", out_dir / f"{record.run_id}.html"
    attempts = attempts_of(events)
    stride = 1 + sum(len(a.commits) for a in attempts) // 120
    for a in attempts:  # on a long run one marker per commit would merge into a solid band
        a.commits = a.commits[::-1][::stride][::-1]  # every stride-th, and the last
    fig = Figure(figsize=(14, 9), dpi=100, layout="constrained")  # no pyplot: no GUI, no globals
    loss_ax, time_ax = fig.subplots(2, 1, height_ratios=[3, 2])
    digest = f"digest {record.digest[:12]}…" if record.digest else "no digest"
    spent = goodput(events)
    share = f"  ·  goodput {100 * spent.goodput:.1f}%" if spent else ""
    fig.suptitle(f"{record.run_id}  ·  {_short(record.spec.name, 40)}  ·  {record.state.value}  ·  "
                 f"{digest}  ·  {record.attempts} attempt{'s' * (record.attempts != 1)}{share}",
                 fontsize=15, fontweight="bold", parse_math=False)  # fmt: skip
    t0 = min((e.at for e in events), default=0.0)
    span = max((e.at for e in events), default=0.0) - t0
    unit, scale = ("h", 3600.0) if span > 7200 else ("min", 60.0) if span > 300 else ("s", 1.0)
    _loss_axes(loss_ax, record, attempts)
    _time_axes(time_ax, attempts, t0, scale, unit)
    fig.draw_without_rendering()  # fixes the layout, so labels can be measured where they go
    renderer = FigureCanvasAgg(fig).get_renderer()  # type: ignore[no-untyped-call]
    step_marks, time_marks = _marks(events, attempts, t0, scale)
    _place(loss_ax, renderer, step_marks, lanes=8)
    taken = _place(time_ax, renderer, time_marks, lanes=3)
    _time_labels(time_ax, renderer, attempts, (t0, scale), taken)
    fig.savefig(png)
    page.write_text(html_page(record, events, png.read_bytes()), encoding="utf-8")
    return png, page


def _loss_axes(ax: Axes, record: RunRecord, attempts: list[Attempt]) -> None:
    ax.set_xlim(0, max([record.spec.total_steps, *(a.last_step for a in attempts)]) * 1.01)
    for a in attempts:
        ax.plot(a.steps, a.losses, color=_color(a), lw=2, label=f"attempt {a.started.attempt} · "
                f"{_w(a.started.worker)} · token {a.started.token}")  # fmt: skip
        xs = [c.step for c in a.commits]  # out of the layout: an empty unclipped line sits at 0,0
        ax.plot(xs, [0.0] * len(xs), "|", color=_color(a), ms=14, mew=2.5, in_layout=False,
                transform=ax.get_xaxis_transform(), clip_on=False)  # fmt: skip
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], ls="", marker="|", ms=14, mew=2.5, color=GREY,
                          label="checkpoint committed"))  # fmt: skip
    # Steps an attempt computed past where the next one resumed were thrown away.
    redone = [a.redone for a in attempts if a.redone is not None]
    for first, last in redone:
        ax.axvspan(first, last, color=RED, alpha=0.08, lw=0)
    if redone:
        handles.append(Patch(color=RED, alpha=0.15, label="steps redone after a failure"))
    # "best" is chosen at draw time, so it also avoids the marker labels placed later.
    ax.legend(handles=handles, loc="best", fontsize=10, framealpha=0.92)
    losses = [x for a in attempts for x in a.losses if math.isfinite(x)]
    if losses:  # the top ~third stays free for the marker labels
        lo, hi = min(losses), max(losses)
        if lo > 0 and hi / lo > 20:
            ax.set_yscale("log")
            ax.set_ylim(lo / 1.3, lo * (hi * 1.3 / lo) ** 1.5)
        else:
            pad = (hi - lo) or abs(hi) or 1.0
            ax.set_ylim(lo - 0.05 * pad, hi + 0.55 * pad)
    else:
        ax.text(0.5, 0.4, "no loss reported", transform=ax.transAxes, ha="center", color=GREY)
    ax.set_xlabel("step", fontsize=11), ax.set_ylabel("loss", fontsize=11)
    ax.grid(alpha=0.3)


def _marks(events: list[Event], attempts: list[Attempt], t0: float, scale: float
           ) -> tuple[Marks, Marks]:  # fmt: skip
    """Where interruptions and resumes happened in steps, and the run's own events in time."""
    steps = _attempt_marks(attempts)
    event_steps, times = _event_marks(events, t0, scale)
    steps += event_steps
    return [(x, _short(t), c) for x, t, c in steps], [(x, _short(t), c) for x, t, c in times]


def _attempt_marks(attempts: list[Attempt]) -> Marks:
    """Each attempt's resume and how it ended, in steps."""
    steps: Marks = []
    for a in attempts:
        r, w, step = a.resumed, _w(a.started.worker), a.last_step
        if r is not None and (a.index > 0 or r.step > 0 or r.damaged):
            skipped = f", skipped damaged {r.damaged}" if r.damaged else ""
            steps.append((r.step, f"resumed @{r.step} on {_w(r.worker)}{skipped}", GREEN))
        match a.end_event:
            case ev.Preempted(step=p):
                steps.append((p, f"preempted {w} @{p}", ORANGE))
            case ev.Fenced(reason=why):
                steps.append((step, f"fenced {w}: {why}", RED))
            case ev.AttemptFailed(reason=why):
                steps.append((step, f"attempt {a.started.attempt} failed: {why}", RED))
            case ev.RankLost(rank=rank, lost=who, step=p):
                steps.append((p, f"rank {rank} lost ({_w(who)}) @{p}", ORANGE))
        if a.outcome == "died":
            steps.append((step, f"{w} died @{step}", RED))
    return steps


def _event_marks(events: list[Event], t0: float, scale: float) -> tuple[Marks, Marks]:
    """The run's own events: in steps, and in time since `t0` (in units of `scale` s)."""
    steps: Marks = []
    times: Marks = []
    last = 0
    for e in events:
        at = (e.at - t0) / scale  # a step for events that have none: the last one reported
        match e:
            case ev.Progress():
                last = e.step
            case ev.Accepted():
                times.append((at, "accepted", GREY))
            case ev.CommitRefused():
                steps.append((e.step, f"commit refused @{e.step}", RED))
            case ev.Resized():
                text = f"resized {e.from_ranks}→{e.to_ranks} @{e.step}"
                steps.append((e.step, text, AMBER))
                times.append((at, text, AMBER))
            case ev.Diverged():
                text = f"diverged @{e.step}: {e.metric} {e.expected} → {e.got}"
                steps.append((e.step, text, RED))
                times.append((at, text, RED))
            case ev.Completed():
                steps.append((e.step, f"completed @{e.step}", GREEN))
                times.append((at, "completed", GREEN))
            case (
                ev.RunWarning() | ev.Redispatched() | ev.HandedOver() | ev.Failed()
                | ev.Cancelled() | ev.Rejected()
            ):  # fmt: skip
                text = f"{kind_of(e)}: {e.kind if isinstance(e, ev.RunWarning) else e.reason}"
                color = {"warning": AMBER, "redispatched": GREY, "handed_over": ORANGE}.get(
                    kind_of(e), RED
                )
                steps.append((last, text, color))
                times.append((at, text, color))
    return steps, times


def _place(ax: Axes, renderer: RendererBase, items: Marks, lanes: int) -> list[Bbox]:
    """Draw a dashed line at each marker and its label in the highest free lane from the
    top, running right of the line or else left of it; overlap is measured, not guessed.
    A label with no free spot goes to the lowest lane, on a side that stays in the axes."""
    frame = ax.get_window_extent(renderer)
    placed: list[Bbox] = []
    lane_h = 24 / frame.height  # one 10 pt line plus its box

    def label(x: float, y: float, ha: str, text: str, color: str) -> tuple[Text, Bbox]:
        box = {"boxstyle": "round,pad=0.25", "fc": "white", "ec": color, "alpha": 0.92}
        t = ax.text(x, y, text, transform=ax.get_xaxis_transform(), va="top", ha=ha, color=color,
                    fontsize=10, parse_math=False, zorder=6, in_layout=False, bbox=box)  # fmt: skip
        return t, t.get_window_extent(renderer).padded(5)

    for x, text, color in sorted(items, key=lambda item: item[0]):
        px = ax.transData.transform((x, 0))[0]
        sides = ("left", "right") if px < frame.x0 + 0.6 * frame.width else ("right", "left")
        spots = [(1 - 0.012 - k * lane_h, ha) for k in range(lanes) for ha in sides]
        chosen, inside = None, spots[-1]
        for y, ha in spots:
            t, box = label(x, y, ha, text, color)
            t.remove()
            if frame.x0 - 8 <= box.x0 and box.x1 <= frame.x1 + 8:
                inside = (y, ha)
                if not any(box.overlaps(p) for p in placed):
                    chosen = (y, ha)
                    break
        y, ha = chosen or inside
        placed.append(label(x, y, ha, text, color)[1])
        ax.axvline(x, ymax=y, color=color, ls="--", lw=1.3, alpha=0.8, zorder=1)
    beyond = [Bbox.from_extents(0, 0, frame.x0, 1e4), Bbox.from_extents(frame.x1, 0, 1e4, 1e4)]
    return placed + beyond  # what later text must avoid: these labels and beyond the axes


def _time_axes(ax: Axes, attempts: list[Attempt], t0: float, scale: float, unit: str) -> None:
    workers = list(dict.fromkeys(a.started.worker for a in attempts))
    for a in attempts:
        start, alive, end = ((t - t0) / scale for t in (a.started.at, a.alive_until, a.end_at))
        solid = alive if a.outcome == "died" else end
        ax.barh(a.row, solid - start, left=start, height=0.5, color=_color(a), alpha=0.85)
        if a.outcome == "died":  # the lease had to lapse before anyone could take over
            ax.barh(a.row, end - alive, left=alive, height=0.5, color="none", ec=RED,
                    hatch="//", lw=1, alpha=0.7)  # fmt: skip
        marker, color = END_MARKER.get(a.outcome, ("X", RED))
        ax.plot(solid, a.row, marker, color=color, ms=22 if marker == "*" else 16, mec="white",
                zorder=6)  # fmt: skip
        # Commits sit on the bar's upper edge, clear of its label and of the end marker.
        ts = [(c.at - t0) / scale for c in a.commits]
        ax.plot(ts, [a.row - 0.25] * len(ts), "D", color="white", mec="black", ms=6.5, zorder=5)
    ax.set_yticks(range(len(workers)), [_w(w) for w in workers], fontsize=11)
    # Rows read top-down; the room above the first row is for the event labels.
    ax.set_ylim(len(workers) - 0.5, -0.5 - max(1.0, 0.4 * len(workers)))
    ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
    ax.set_xlabel(f"wall time since the first event ({unit})", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    keys = [("D", "white", 7, "commit"), ("v", ORANGE, 11, "preempted"),
            ("X", RED, 11, "died / fenced / failed"), ("*", GREEN, 15, "completed")]  # fmt: skip
    handles: list[Any] = [Line2D([], [], ls="", marker=m, color=c, mec="black" if c == "white"
                                 else c, ms=size, label=k) for m, c, size, k in keys]  # fmt: skip
    handles.insert(3, Patch(fc="none", ec=RED, hatch="//", label="waiting for the lease to lapse"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=5,
              frameon=False, fontsize=10)  # fmt: skip


def _time_labels(ax: Axes, renderer: RendererBase, attempts: list[Attempt],
                 origin: tuple[float, float], placed: list[Bbox]) -> None:  # fmt: skip
    """Name each bar inside it if the name fits (else a shorter one, else none), and put step
    numbers above commit markers, leaving out any that would overlap a label in `placed`."""
    t0, scale = origin
    for a in attempts:
        y, s = a.row, a.started
        x0 = (s.at - t0) / scale
        x1 = ((a.alive_until if a.outcome == "died" else a.end_at) - t0) / scale
        room = ax.transData.transform((x1, y))[0] - ax.transData.transform((x0, y))[0] - 30
        # The row already names the worker; the end marker covers the bar's last ~11 px.
        for text in (f"#{s.attempt} · token {s.token} · steps {a.first_step}→{a.last_step}",
                     f"#{s.attempt} tok {s.token}", f"#{s.attempt}"):  # fmt: skip
            t = ax.text((x0 + x1) / 2, y + 0.02, text, ha="center", va="center", color="white",
                        fontsize=10, fontweight="bold", parse_math=False)  # fmt: skip
            if t.get_window_extent(renderer).width <= room:
                break
            t.remove()
        for c in a.commits:
            t = ax.text((c.at - t0) / scale, y - 0.36, str(c.step), ha="center", va="bottom",
                        fontsize=9, color="#333333")  # fmt: skip
            box = t.get_window_extent(renderer).padded(2)
            if any(box.overlaps(p) for p in placed):
                t.remove()
            else:
                placed.append(box)


def _w(worker: str) -> str:  # ids can be long host names: keep both ends, which differ
    return worker if len(worker) <= 20 else f"{worker[:9]}…{worker[-10:]}"


def _short(text: str, limit: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
