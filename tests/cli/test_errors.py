"""What a command prints when JetStream could not answer: one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from nats.errors import NoRespondersError
from nats.js.errors import BucketNotFoundError

from baton.cli.common import run
from baton.client.errors import SEEN, needs


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    SEEN.reset()
    yield
    SEEN.reset()


def exits(
    exc: Exception, what: str = "runs bucket", site: str = "", hub_up: bool | None = None
) -> int:
    async def fails() -> None:
        SEEN.site, SEEN.hub_up = site, hub_up  # as `common.with_nats` finds them
        with needs(what):
            raise exc

    with pytest.raises(typer.Exit) as ended:
        run(fails)
    return ended.value.exit_code


def test_a_site_cut_off_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert exits(BucketNotFoundError(), site="lab1", hub_up=False) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "the hub is unreachable from this site (cut off?)" in err
    assert "needs the hub's runs bucket" in err


def test_a_site_whose_link_does_not_carry_the_read_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert exits(NoRespondersError(), "workers bucket", "lab1", hub_up=True) == 1
    err = capsys.readouterr().err
    assert "workers bucket, which site lab1's link does not carry" in err
    assert err.count("\n") == 1


def test_at_the_hub_a_missing_bucket_or_a_silent_jetstream_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert exits(BucketNotFoundError()) == 1
    assert exits(TimeoutError(), "events stream") == 1
    first, second = capsys.readouterr().err.splitlines()
    assert "runs bucket, which does not exist on this server" in first
    assert "JetStream did not answer (TimeoutError)" in second and "events stream" in second


def test_anything_else_still_raises() -> None:
    async def fails() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        run(fails)


def test_a_stack_that_is_not_up_is_said_in_one_line_not_waited_for(tmp_path: Path) -> None:
    """Nothing listens where the command looks: it says so once its connection's bounded
    wait is over (nats-py alone would try for as long as it reconnects: for ever)."""
    from baton.stack.cluster import free_ports

    (port,) = free_ports(1)
    done = subprocess.run(
        [sys.executable, "-m", "baton", "runs", "-s", f"nats://127.0.0.1:{port}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "Is the stack up?" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
