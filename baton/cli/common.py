"""What every `baton` command shares: the app, consoles, options, error handling.

Imported by `baton --help`, so it imports nothing heavy at the top: NATS (and aiohttp
under it), msgspec, asyncio, OpenTelemetry and the shared modules that use them are
imported where a command first needs them. `tests/cli/test_imports.py` holds it to that.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from typer.core import TyperCommand

from baton.client.connection import OPERATOR_AUTH_FILE
from baton.client.errors import SEEN, CliError, explain
from shared.errors import BatonError

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class _Command(TyperCommand):
    """A command that sets up telemetry once its arguments have parsed, just before it
    runs, rather than when `baton` starts: `--help` and a bad option never import
    OpenTelemetry. Only in the `baton` process itself (`traced()`): a program that calls
    the app in-process (a test's CliRunner) keeps its own providers, which OpenTelemetry
    would not let it install after ours."""

    def invoke(self, ctx: Any) -> Any:
        if _tracing:
            from shared import telemetry

            # Traces start at `baton submit`; nothing is exported unless
            # OTEL_EXPORTER_OTLP_ENDPOINT is set, and setting up costs no connection.
            telemetry.setup("baton-cli")
        return super().invoke(ctx)


_tracing = False


def traced() -> None:
    """Called by `baton`'s entry point: its commands set up the CLI's telemetry."""
    global _tracing
    _tracing = True


class OwnTelemetry(TyperCommand):
    """A command whose process sets up its own telemetry under its own name: `baton service
    <name>` runs a service, which calls itself `baton-<name>` (OpenTelemetry keeps the first
    providers installed in a process, so `baton-cli` must not come first)."""


class Typer(typer.Typer):
    """A `typer.Typer` whose commands are `_Command`s."""

    def command(
        self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kwargs: Any
    ) -> Callable[[F], F]:
        return super().command(name, cls=cls or _Command, **kwargs)


def stop_telemetry() -> None:
    """Flush and stop what a command's telemetry set up; nothing if none ran."""
    if "shared.telemetry" in sys.modules:
        from shared import telemetry

        telemetry.shutdown()


app = Typer(
    name="baton",
    help="Resumable PyTorch training on spare, unreliable GPUs.",
    no_args_is_help=True,
    add_completion=False,
)
out = Console()
err = Console(stderr=True)

Server = Annotated[
    str,
    typer.Option("--server", "-s", envvar="NATS_URL", help="NATS server URL(s), comma-separated."),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
Site = Annotated[
    str,
    typer.Option(
        "--site",
        envvar="BATON_SITE",
        help="Publish as this site (--server is then its leaf node): stored at the site "
        "while its link to the hub is down.",
    ),
]
SERVICES = ("dispatcher", "trainer", "checkpointer", "reaper")
DEFAULT_AUTH_FILE = OPERATOR_AUTH_FILE
DASHBOARD_AUTH_FILE = Path(".baton") / "auth" / "dashboard.env"
"""`baton ui`'s default credentials next to `baton up`: the least-privilege `dashboard`."""


class Connection:
    """Credentials and TLS for every client command, named like the nats CLI's options
    and read from the same environment variables; set by the app's callback."""

    creds: str | None = None
    auth_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def options(cls, default: Path = DEFAULT_AUTH_FILE) -> dict[str, Any]:
        """Credentials: `--creds` (a JWT creds file), else `--auth-file`, else NATS_USER and
        NATS_PASSWORD, else the file that `baton up` wrote in ./.baton (`default`, the
        operator's unless a command asks for its own role's) — so the CLI next to a stack it
        started just works. The order is `baton.client.connection.options`, which the
        Python API (`baton.Client`) follows too."""
        from baton.client import connection

        return connection.options(
            cls.creds, cls.auth_file, cls.tls_ca, cls.tls_cert, cls.tls_key, default
        )


def run(coro: Callable[[], Awaitable[T]]) -> T:
    """Run a command's coroutine: the one place where what it raised becomes a message of
    one line and an exit code — a JetStream that did not answer too (`errors.explain`: at a
    site, the hub cut off, or a read its link does not carry)."""
    import asyncio

    SEEN.reset()
    try:
        return asyncio.run(coro())  # type: ignore[arg-type]
    except CliError as exc:
        _error(str(exc))
        raise typer.Exit(exc.code) from None
    except BatonError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    except Exception as exc:
        explained = explain(exc, _command())
        if explained is None:
            raise
        _error(str(explained))
        raise typer.Exit(explained.code) from None


def _error(message: str) -> None:
    """One line on stderr, however long (rich would wrap it at the terminal's width)."""
    err.print(f"[red]error:[/red] {message}", soft_wrap=True)


def _command() -> str:
    """The running command's name, as typed after `baton` ("runs", "dlq list")."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return "this command"
    return ctx.command_path.partition(" ")[2] or ctx.command_path


def fail(message: str, code: int = 1) -> NoReturn:
    """Print `message` as an error and exit with `code` (2: bad usage)."""
    _error(message)
    raise typer.Exit(code)


def print_json(obj: Any) -> None:
    import json

    import msgspec

    sys.stdout.write(json.dumps(json.loads(msgspec.json.encode(obj)), indent=2) + "\n")


async def with_nats(server: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    """`fn(nc)` on a connection to `server`. At a site's leaf, a failure is looked into
    before the connection closes: did the hub's JetStream answer across the link? (`run`
    words the error from that.)"""
    from baton.client import calls as client

    SEEN.reset()
    nc = await client.open_nats(server, **Connection.options())
    SEEN.site = client.site_of(nc)
    try:
        return await fn(nc)
    except Exception:
        if SEEN.site:
            SEEN.hub_up = await client.hub_answers(nc)
        raise
    finally:
        await nc.close()


async def call(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


def store_of(server: str, explicit: str | None) -> str:
    """The checkpoint store: --store, else BATON_STORE, else a `baton up` in ./.baton's,
    else where the hub says it is (`shared.state.hub`): a client with only NATS_URL and
    credentials finds it."""
    from baton.client import calls as client

    try:
        return client.store_url(explicit)
    except CliError:
        return run(lambda: with_nats(server, client.hub_store))


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
