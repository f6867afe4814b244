"""`baton queue`: a pool's queue as the scheduler (in the dispatcher) answers for it — the
runs waiting, in the order its next pass takes them, each with why it waits; the runs
training, and which of them make room for another; the owners' shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import Json, Server, app, call, out, print_json, run, with_nats

if TYPE_CHECKING:
    from rich.table import Table

    from shared.contracts.queue import OwnerShare, QueueView, Training, Waiting

DEFAULT = "nats://127.0.0.1:4222"


@app.command("queue")
def queue_command(
    server: Server = DEFAULT,
    pool: Annotated[str, typer.Option(help="The pool whose queue to show.")] = "default",
    limit: Annotated[
        int, typer.Option(min=1, max=2000, help="Waiting runs to list at most, from the front.")
    ] = 200,
    as_json: Json = False,
) -> None:
    """A pool's queue, as the scheduler sees it now: the runs waiting in the order it takes
    them and why each waits, the runs training (and which make room for another), and each
    owner's share of the pool. Exit 1 when no scheduler answers (the dispatcher is down)."""
    from baton.client import scheduling

    run(lambda: call(scheduling.check_pool, pool))
    view = run(lambda: with_nats(server, lambda nc: scheduling.queue_view(nc, pool, limit)))
    if as_json:
        print_json(view)
        return
    for part in render(view):
        out.print(part, soft_wrap=isinstance(part, str))


def render(view: QueueView) -> list[Any]:
    """What `baton queue` prints for `view`: a header line, then the waiting runs, the
    training runs and the owners, each a table (or a line saying there are none)."""
    parts: list[Any] = [header(view)]
    if view.waiting:
        parts.append(waiting_table(view.waiting))
        if view.more:
            parts.append(f"… and {view.more} more waiting (--limit)")
    else:
        parts.append("nothing waits")
    parts.append(training_table(view.training) if view.training else "nothing trains")
    if view.owners:
        parts.append(owners_table(view.owners))
    return parts


def header(view: QueueView) -> str:
    """`pool default: 1 live trainer, 0 free; 3 waiting, 1 training`."""
    waiting = len(view.waiting) + view.more
    trainers = f"{view.trainers} live trainer{'' if view.trainers == 1 else 's'}"
    return (
        f"pool {view.pool}: {trainers}, {view.free} free; {waiting} waiting, "
        f"{len(view.training)} training"
    )


def who(owner: str) -> str:
    """An owner as people read it: an operator's runs have none."""
    return owner or "operator"


def waited(seconds: float) -> str:
    """A duration in its largest sensible unit: `42s`, `7m`, `3.5h`, `2.1d`."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def hours(seconds: float) -> str:
    """Trainer-seconds as trainer-hours, to three significant digits (`0.0123`, `12.3`)."""
    return f"{seconds / 3600:.3g}"


def waiting_table(rows: list[Waiting]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        "#", "run", "owner", "priority", "state", "ranks", "waited", "preempted", "why",
        title="waiting, in the order the scheduler takes them", title_justify="left",
    )  # fmt: skip
    for w in rows:
        t.add_row(
            str(w.position + 1), w.run_id, who(w.owner), str(w.priority), w.state, str(w.ranks),
            waited(w.queued_s), str(w.preemptions), escape(w.waiting),
        )  # fmt: skip
    return t


def training_table(rows: list[Training]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        "run", "owner", "priority", "ranks", "where", "preempted", "note", title="training",
        title_justify="left",
    )  # fmt: skip
    for r in rows:
        where = r.worker or (f"site {r.site}" if r.site else "-")
        if r.site and r.worker:
            where = f"{r.worker} (site {r.site})"
        note = escape(f"leaving: {r.leaving}") if r.leaving else ""
        t.add_row(
            r.run_id, who(r.owner), str(r.priority), str(r.ranks), where, str(r.preemptions),
            note,
        )  # fmt: skip
    return t


def team(name: str) -> str:
    """A team as people read it: `@owner`, a team of one, is none."""
    return "-" if name.startswith("@") else name


def owners_table(rows: list[OwnerShare]) -> Table:
    from rich.table import Table

    t = Table(
        "owner", "weight", "team", "share", "entitled", "holding", "usage (trainer-h)", "quota",
        "max priority", "preempted", title="owners", title_justify="left",
    )  # fmt: skip
    for o in rows:
        t.add_row(
            who(o.owner), f"{o.weight:g}", team(o.team), f"{100 * o.share:.1f}%",
            f"{o.entitled:.2f}", str(o.holding), hours(o.usage_s),
            "-" if o.quota is None else str(o.quota),
            "any" if o.max_priority is None else str(o.max_priority), str(o.preempted),
        )  # fmt: skip
    return t
