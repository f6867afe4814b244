"""The pools' table in force: read from a TOML file (a bad one named by its field), put in
force once for every service, read back within `FRESH_S`, and applied again from the
dispatcher's file when it changes — never when it does not, never a file that does not
read."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client

from shared.contracts.pools import Pool, PoolTable
from shared.errors import ConfigError
from shared.state.policy import Policy, PoolsFile, load_table


def test_a_bad_table_is_refused_naming_its_field(tmp_path: Path) -> None:
    bad = tmp_path / "pools.toml"
    bad.write_text("[pools.gpu]\nprice = { cuda = -1 }\n")
    with pytest.raises(ConfigError, match=r"pools\.toml.*price"):
        load_table(str(bad))
    assert load_table("") == PoolTable()


def test_an_overdraft_is_the_owners_else_the_pools(tmp_path: Path) -> None:
    table = tmp_path / "pools.toml"
    table.write_text(
        "[pools.gpu]\noverdraft = 5\n[pools.gpu.owners.alice]\noverdraft = 20\n"
        "[pools.gpu.owners.bob]\nweight = 2\n"
    )
    gpu = load_table(str(table)).pool("gpu")
    assert (gpu.overdraft_of("alice"), gpu.overdraft_of("bob"), gpu.overdraft_of("eve")) == (
        20.0, 5.0, 5.0,
    )  # fmt: skip
    assert Pool().overdraft_of("eve") == 0.0  # paused as soon as a balance is below zero
    table.write_text("[pools.gpu]\noverdraft = -1\n")
    with pytest.raises(ConfigError, match="overdraft"):
        load_table(str(table))


async def test_a_table_is_in_force_for_every_reader(declared: Client, tmp_path: Path) -> None:
    js = declared.jetstream()
    fallback = PoolTable(pools={"gpu": Pool(max_priority=1)})
    reader = Policy(js, fallback)
    assert (await reader.current()) == fallback  # none applied yet: its own
    table = PoolTable(pools={"gpu": Pool(max_priority=7)})
    writer = Policy(js, PoolTable())
    assert await writer.apply(table)
    assert not await writer.apply(table)  # already in force
    await reader.refresh()
    assert reader.table == table and reader.revision == writer.revision


async def test_the_dispatchers_file_is_applied_when_it_changes(
    declared: Client, tmp_path: Path
) -> None:
    path = tmp_path / "pools.toml"
    path.write_text("[pools.gpu]\nmax_priority = 3\n")
    policy = Policy(declared.jetstream(), PoolTable())
    follow = PoolsFile(str(path), policy)
    await follow.check()
    first = policy.revision
    assert first and policy.table.pool("gpu").max_priority == 3
    await follow.check()
    assert policy.revision == first  # unchanged: not applied again
    path.write_text("[pools.gpu]\nmax_priority = 'x'\n")
    await follow.check()
    assert policy.revision == first and policy.table.pool("gpu").max_priority == 3
    path.write_text("[pools.gpu]\nmax_priority = 9\n")
    await follow.check()
    assert policy.revision > first and policy.table.pool("gpu").max_priority == 9
