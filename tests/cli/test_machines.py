"""`baton token create`, `baton join`, `baton machines` before they reach a hub: durations,
tokens that cannot be one, a machine that never joined, the systemd unit `--install`
writes. (Joining a hub, revoking, a clustered hub: tests/e2e/test_machines.py and
tests/e2e/test_people.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from baton.cli.app import app
from baton.cli.machines import seconds
from baton.stack.machine import MachineConfig, config_path, load, systemd_unit


def test_durations_read_as_people_write_them() -> None:
    assert [seconds(t) for t in ("90", "90s", "15m", "1h", "7d", "1.5h")] == [
        90, 90, 900, 3600, 604800, 5400,
    ]  # fmt: skip
    for bad in ("", "0", "-1h", "1w", "h", "1 h"):
        with pytest.raises(ValueError, match="not a duration"):
            seconds(bad)


def test_a_bad_ttl_pool_or_site_is_refused_before_anything_is_asked() -> None:
    done = CliRunner().invoke(app, ["token", "create", "--ttl", "soon"])
    assert done.exit_code == 2 and "--ttl: 'soon' is not a duration" in done.output
    done = CliRunner().invoke(app, ["token", "create", "--pool", "a.>"])
    assert done.exit_code == 2 and "not a pool name" in done.output
    done = CliRunner().invoke(app, ["token", "create", "--site", "lab.1"])
    assert done.exit_code == 2 and "--site: 'lab.1' is not a site's name" in done.output


def test_join_refuses_what_cannot_be_a_token_and_keeps_nothing(tmp_path: Path) -> None:
    data = tmp_path / "m"
    runner = CliRunner()
    done = runner.invoke(app, ["join", "nats://127.0.0.1:1", "--token", "letmein",
                               "--data-dir", str(data)])  # fmt: skip
    assert done.exit_code == 2 and "not a join token" in done.output
    done = runner.invoke(app, ["join", "--data-dir", str(data)])
    assert done.exit_code == 2 and "needs the hub's URL and --token" in done.output
    assert not data.exists()


def test_install_writes_a_unit_that_starts_the_machine_again(tmp_path: Path) -> None:
    data = tmp_path / "m"
    data.mkdir()
    conf = MachineConfig(url="nats://hub:4222", machine="m-0123456789ab", pool="default",
                         store="s3://b/p", trainers=1)  # fmt: skip
    config_path(data).write_text(json.dumps({
        "url": conf.url, "machine": conf.machine, "pool": conf.pool, "store": conf.store,
        "trainers": 1,
    }))  # fmt: skip
    assert load(data) == conf
    units = tmp_path / "units"
    done = CliRunner().invoke(
        app, ["join", "--data-dir", str(data), "--install", "--unit-dir", str(units)]
    )
    assert done.exit_code == 0, done.output
    unit = (units / "baton-machine.service").read_text()
    assert f"join --data-dir {data.absolute()}" in unit
    assert "KillMode=mixed" in unit and "WantedBy=multi-user.target" in unit
    assert unit == systemd_unit(data, unit.split("ExecStart=")[1].split(" join ")[0].split())
    assert os.access(units / "baton-machine.service", os.R_OK)
