"""The CLI answers at once: `--help` and a bad option import neither torch (only `baton pull`
needs it, to recompute a digest) nor NATS (nats-py imports aiohttp), nor what only a
running command needs. Each command imports those in its body.

Checked by what the import log lists, never by the clock."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Top-level packages that `baton --help` must not import.
HEAVY = ("torch", "torchdata", "numpy", "nats", "aiohttp", "msgspec", "opentelemetry")


def imported_by(*args: str) -> set[str]:
    """The modules that `python -m baton.cli.app ARGS` imports, from `-X importtime`."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "baton.cli.app", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 2), done.stderr[-2000:]  # 2: a usage error, by design
    return {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["submit", "--help"],
        ["dlq", "list", "--help"],
        ["runs", "--state"],  # an option without its value
        ["queue", "--pool"],
        ["credits", "topup", "--help"],
        ["join", "--help"],
        ["machines", "revoke", "--help"],
        ["token", "create", "--help"],
        ["pools", "apply", "--help"],
        ["no-such-command"],
    ],
    ids=" ".join,
)
def test_help_and_usage_errors_import_nothing_heavy(args: list[str]) -> None:
    imported = imported_by(*args)
    assert "baton.cli.common" in imported, "the import log does not list the CLI itself"
    assert "baton.cli.ops" in imported, "the import log does not list the operator commands"
    heavy = sorted({m.split(".")[0] for m in imported}.intersection(HEAVY))
    assert not heavy, f"baton {' '.join(args)} imports {', '.join(heavy)}"


def test_baton_service_leaves_telemetry_to_the_service() -> None:
    """`baton service NAME` (how compose runs services) must not install the CLI's
    telemetry first: OpenTelemetry keeps the first providers of a process, and the service's
    spans would be exported as `baton-cli`."""
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from baton.cli.app import app\n"
        "from baton.cli.common import traced\n"
        "traced()  # as `baton` itself runs its commands\n"
        "CliRunner().invoke(app, ['service', 'no-such-service'])\n"
        "from shared import telemetry\n"
        "print(telemetry._installed is None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]
