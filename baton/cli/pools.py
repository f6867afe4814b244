"""`baton pools show` and `baton pools apply FILE`: the pools' table in force — priorities,
owners' terms, fair share, preemption, prices — which every service follows live from the
`baton_policy` bucket (`shared.state.policy`), and putting a new one in force."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import Json, Server, Typer, app, call, out, print_json, run, with_nats

if TYPE_CHECKING:
    from shared.contracts.pools import Pool, PoolTable

DEFAULT = "nats://127.0.0.1:4222"

pools_app = Typer(help="The pools' table in force: show it, apply a new one.", no_args_is_help=True)
app.add_typer(pools_app, name="pools")


@pools_app.command("show")
def show(server: Server = DEFAULT, as_json: Json = False) -> None:
    """The pools' table in force and its revision."""
    from baton.client import scheduling

    table, revision = run(lambda: with_nats(server, scheduling.table_in_force))
    if as_json:
        import json

        import msgspec

        print_json({"revision": revision, **json.loads(msgspec.json.encode(table))})
        return
    for part in render(table, revision):
        out.print(part, soft_wrap=isinstance(part, str))


@pools_app.command("apply")
def apply(
    file: Annotated[Path, typer.Argument(help="The pools' table, TOML ([pools.<name>] …).")],
    server: Server = DEFAULT,
    as_json: Json = False,
) -> None:
    """Put FILE's table in force for every service, at once and without a restart; a file
    that does not parse, or names a field wrongly, is refused (exit 2) and nothing is
    applied. The dispatcher's own BATON_POOLS_FILE is applied again when it changes."""
    from baton.client import scheduling

    table = run(lambda: call(read_table, file))
    changed, revision = run(lambda: with_nats(server, lambda nc: scheduling.apply_table(nc, table)))
    if as_json:
        print_json({"changed": changed, "revision": revision, "pools": sorted(table.pools)})
    elif changed:
        out.print(f"applied {file}: revision {revision} is in force", soft_wrap=True)
    else:
        said = f"unchanged: the table in force (revision {revision}) already is {file}'s"
        out.print(said, soft_wrap=True)


def read_table(file: Path) -> PoolTable:
    """`file` as a pools' table; `CliError` (exit 2) naming what is wrong."""
    from baton.client.errors import CliError
    from shared.errors import ConfigError
    from shared.state.policy import load_table

    if not file.is_file():
        raise CliError(f"no such file: {file}", 2)
    try:
        return load_table(str(file))
    except ConfigError as exc:
        raise CliError(str(exc), 2) from None


def render(table: PoolTable, revision: int) -> list[Any]:
    """What `baton pools show` prints: the revision, a row per pool, a row per owner."""
    from rich.table import Table

    if not revision:
        head = "no table applied yet: each service uses its own BATON_POOLS_FILE, or the defaults"
    else:
        head = f"the pools' table in force: revision {revision}"
    parts: list[Any] = [head]
    if not table.pools:
        parts.append("no pool configured: every pool has the defaults")
        return parts
    t = Table(
        "pool", "priorities", "default", "max", "min run", "preemption", "fair share", "price",
        "rate/h",
    )  # fmt: skip
    owners = Table("pool", "owner", "weight", "team", "quota", "max priority")
    for name, pool in sorted(table.pools.items()):
        t.add_row(name, *pool_cells(pool))
        for owner, terms in sorted(pool.owners.items()):
            owners.add_row(
                name, owner, f"{terms.weight:g}", terms.team or "-",
                "-" if terms.quota is None else str(terms.quota),
                str(pool.highest_priority(owner)),
            )  # fmt: skip
    parts.append(t)
    if owners.row_count:
        parts.append(owners)
    return parts


def pool_cells(pool: Pool) -> list[str]:
    """A pool's row in `baton pools show`, after its name."""
    ranked = sorted(pool.priorities.items(), key=lambda kv: kv[1])
    classes = ", ".join(f"{k}={v}" for k, v in ranked)
    price = ", ".join(f"{k}={v:g}/s" for k, v in sorted(pool.price.items())) or "free"
    share = f"half-life {pool.fair_share.half_life_s:g}s, margin {pool.fair_share.margin:g}"
    return [
        classes or "-", str(pool.default_priority), str(pool.max_priority),
        f"{pool.min_run_s:g}s", "on" if pool.preemption else "off", share, price,
        f"{pool.rate_per_hour:g}",
    ]  # fmt: skip
