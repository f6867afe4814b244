"""`baton rounds`: a replicated run's replicas and outer rounds (docs/diloco.md), read from
its replicas' records and `round` events; `--replay` recomputes the round log from the
store. `baton status` and `baton report` of a replicated run show the same summary.

As everywhere in the CLI, the command imports NATS and the shared modules in its body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import Json, Server, app, out, print_json, run, store_of, with_nats

if TYPE_CHECKING:
    from nats.aio.client import Client

    from shared.contracts import RunRecord
    from shared.contracts.events import Event
    from shared.contracts.rounds import RoundNote


@dataclass
class Replicated:
    """A replicated run as its replicas' records and events tell it."""

    run_id: str
    records: list[RunRecord]
    events: dict[int, list[Event]] = field(default_factory=dict)

    @property
    def state(self) -> str:
        """FAILED if any replica failed, else RUNNING if any trains, …; COMPLETED once all
        completed."""
        states = [r.state.value for r in self.records]
        for s in ("FAILED", "RUNNING", "PAUSED", "QUEUED", "CANCELLED"):
            if s in states:
                return s
        return "COMPLETED"

    def notes(self) -> list[RoundNote]:
        from shared.contracts.events import Round

        return [e.note for ev in self.events.values() for e in ev if isinstance(e, Round)]

    def rounds(self) -> list[dict[str, Any]]:
        """Each committed round a replica's change joined: who took part, who committed it,
        whether at the deadline, the stragglers, bytes sent and received, the longest wait."""
        by_round: dict[int, dict[str, Any]] = {}
        for n in self.notes():
            if n.outcome != "joined" or not n.replicas:
                continue
            r = by_round.setdefault(n.round, {
                "round": n.round, "replicas": n.replicas, "closed_by": n.closed_by,
                "deadline": n.deadline, "stragglers": n.stragglers, "bytes": 0, "waited_s": 0.0,
            })  # fmt: skip
            r["bytes"] += n.sent_bytes + n.received_bytes
            r["waited_s"] = max(r["waited_s"], n.waited_s)
        return [by_round[k] for k in sorted(by_round)]

    def summary(self) -> list[tuple[str, str]]:
        """The rows `baton status` shows of the rounds."""
        rounds = self.rounds()
        notes = self.notes()
        rows = [("replicas", ", ".join(
            f"{r.spec.replica}: {r.state.value} step {r.step}"
            f"{' @' + (r.site or r.ending_site or 'hub') if r.worker or r.site else ''}"
            for r in self.records
        ))]  # fmt: skip
        if rounds:
            last = rounds[-1]
            mean = sum(r["bytes"] for r in rounds) / len(rounds)
            late = sum(1 for r in rounds if r["deadline"])
            rows += [
                ("rounds", f"{len(rounds)} committed; {late} at the deadline; mean "
                           f"{mean / 1e6:.2f} MB exchanged per round"),
                ("last round", f"{last['round']}: replicas {last['replicas']}, committed by "
                               f"{last['closed_by']}" + (f", stragglers {last['stragglers']}"
                                                         if last["stragglers"] else "")),
            ]  # fmt: skip
        waited = sum(n.waited_s for n in notes)
        discarded = [n for n in notes if n.outcome == "discarded"]
        skipped = [n for n in notes if n.outcome == "skipped"]
        rows.append(("waiting", f"{waited:.1f}s of the replicas' steps waited for rounds"))
        if skipped:
            cut = skipped[-1]
            rows.append(("cut off", f"{len(skipped)} boundary(ies) without the store; last: "
                                    f"replica {cut.replica} at step {cut.step}"))  # fmt: skip
        if discarded:
            rows.append(("discarded", "; ".join(
                f"replica {n.replica} step {n.step} ({n.detail})" for n in discarded
            )))  # fmt: skip
        return rows


async def replicated(nc: Client, run_id: str) -> Replicated | None:
    """The replicated run `run_id` (None: not one), its replicas' records and events."""
    from baton.client import calls as client
    from baton.client.errors import CliError
    from shared.contracts.records import replica_run_id

    try:
        first = await client.record(nc, replica_run_id(run_id, 0))
    except CliError:
        return None
    found = Replicated(run_id, [first])
    for i in range(1, first.spec.max_replicas):
        found.records.append(await client.record(nc, replica_run_id(run_id, i)))
    for r in found.records:
        found.events[r.spec.replica or 0] = await client.readable_history(nc, r.run_id) or []
    return found


def show(rep: Replicated, as_json: bool) -> None:
    """`baton status` of a replicated run."""
    import msgspec
    from rich.table import Table

    from baton.cli.goodput import describe
    from shared.history.goodput import goodput

    spent = [g for ev in rep.events.values() if (g := goodput(ev)) is not None]
    total = sum(spent[1:], spent[0]) if spent else None
    if as_json:
        print_json({
            "run_id": rep.run_id, "state": rep.state, "rounds": rep.rounds(),
            "replicas": [msgspec.to_builtins(r) for r in rep.records],
            "goodput": total.as_dict() if total else None,
        })  # fmt: skip
        return
    spec = rep.records[0].spec
    t = Table(show_header=False, box=None)
    for k, v in [
        ("run", f"{rep.run_id} (replicated: {spec.max_replicas} replicas, {spec.outer.algorithm}"
                f" H={spec.outer.inner_steps})"),
        ("name", spec.name),
        ("state", rep.state),
        *rep.summary(),
        ("goodput", describe(total) if total else "-"),
    ]:  # fmt: skip
        t.add_row(f"[bold]{k}[/bold]", v)
    out.print(t)


@app.command()
def rounds(
    run_id: str,
    server: Server = "nats://127.0.0.1:4222",
    as_json: Json = False,
    replay: Annotated[
        bool, typer.Option("--replay", help="Recompute every round from the store's round log.")
    ] = False,
    store: Annotated[str | None, typer.Option(envvar="BATON_STORE", help="Store URL.")] = None,
) -> None:
    """Show a replicated run's outer rounds: the replicas each took, who committed it, at the
    deadline or not, stragglers, bytes exchanged, the longest wait."""
    from rich.table import Table

    from baton.client.errors import CliError

    async def get(nc: Any) -> Replicated:
        found = await replicated(nc, run_id)
        if found is None:
            raise CliError(f"no replicated run {run_id!r}", 3)
        return found

    rep = run(lambda: with_nats(server, get))
    rows = rep.rounds()
    checked = run(lambda: _replay(rep, store_of(server, store))) if replay else None
    if as_json:
        print_json({"run_id": run_id, "rounds": rows, "replay": checked})
        return
    t = Table("round", "replicas", "committed by", "deadline", "stragglers", "MB", "waited")
    for r in rows:
        t.add_row(str(r["round"]), ",".join(map(str, r["replicas"])), str(r["closed_by"]),
                  "yes" if r["deadline"] else "", ",".join(map(str, r["stragglers"])),
                  f"{r['bytes'] / 1e6:.2f}", f"{r['waited_s']:.1f}s")  # fmt: skip
    out.print(t)
    if checked is not None:
        out.print(f"replayed {checked['rounds']} round(s) from the store: every round's bits "
                  f"match its manifest; outer weights {checked['digest'][:16]}…")  # fmt: skip


async def _replay(rep: Replicated, url: str) -> dict[str, Any]:
    from shared.checkpoint import rounds as log
    from shared.checkpoint.digest import weights_digest
    from shared.checkpoint.store import open_store

    async with open_store(url) as store:
        params, count = await log.replay(store, rep.run_id, rep.records[0].spec.outer)
    return {"rounds": count, "digest": weights_digest(params)}
