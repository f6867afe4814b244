"""`baton people`: the people of a stack, each its own submitter user at the hub, added and
removed while the stack runs (`baton.stack.people`), and `baton up --submitter`'s checks.

A change is written to `<data>/auth/people.json` and the vault first, and only then is the
running stack (if `<data>/run/stack.json` names one) asked to reload, by SIGHUP to `baton
up`'s own process: a stack that starts meanwhile reads the change itself. The command then
waits for the servers' word — a real login, at every hub node — never for a guessed time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import Json, Typer, app, fail, print_json, run

if TYPE_CHECKING:
    from baton.stack.people import People
    from shared.credentials import Credentials

# As in `baton.cli.app`: each command imports NATS and the stack's modules in its body.

people_app = Typer(
    help="The people of a stack: each its own submitter, added or removed while it runs.",
    no_args_is_help=True,
)
app.add_typer(people_app, name="people")

DataDir = Annotated[Path, typer.Option(help="The stack's data directory, as given to `baton up`.")]
TAKE_S = 15.0
"""How long a running stack gets to let a person in, or out, at every hub node."""


def submitters_for_up(
    given: list[str], site: str | None, auth: bool, data_dir: Path
) -> tuple[str, ...]:
    """`baton up --submitter` (repeatable, or `a,b`): the names, each checked before
    anything starts (exit 2 naming the rule)."""
    from baton.stack.people import People

    names = tuple(n.strip() for g in given for n in g.split(",") if n.strip())
    if names and site is not None:
        fail("--submitter is for the hub, not a site: a site has no people", code=2)
    if names and not auth:
        fail("--submitter adds a NATS user: it needs authorization (drop --no-auth)", code=2)
    people = People(data_dir)
    try:
        for i, name in enumerate(names):
            people.check(name, besides=names[:i])
    except ValueError as exc:
        fail(f"--submitter: {exc}", code=2)
    return names


@people_app.command("add")
def add(name: str, data_dir: DataDir = Path(".baton"), as_json: Json = False) -> None:
    """Add a person: its own submitter user, whose credentials are written to
    DATA_DIR/auth/NAME.env (its CLI's `--auth-file`). A running stack lets it in at once."""
    from baton.stack.people import People

    stack = _running(data_dir)
    people = People(data_dir)
    try:
        added = people.add(name)
    except ValueError as exc:
        fail(str(exc), code=2)
    auth_file = people.auth_file(name)
    taken = _apply(stack, name, people, want="in", creds=people.vault.get(name))
    if as_json:
        print_json({"person": name, "added": added, "auth_file": str(auth_file), **taken})
        return
    said = "added" if added else "already a person of this stack"
    _say(f"{name}: {said}; credentials in {auth_file} (`baton --auth-file FILE …`)")
    _say_where(taken, name, data_dir, "in")


@people_app.command("remove")
def remove(name: str, data_dir: DataDir = Path(".baton"), as_json: Json = False) -> None:
    """Remove a person: its credentials are deleted, and a running stack refuses its login
    and closes its connections at once. Its runs go on."""
    from baton.stack.people import People

    stack = _running(data_dir)
    people = People(data_dir)
    try:
        creds = people.remove(name)
    except ValueError as exc:
        fail(str(exc), code=2)
    if creds is None:
        fail(f"no person {name!r} in {people.path}", code=3)
    taken = _apply(stack, name, people, want="out", creds=creds)
    if as_json:
        print_json({"person": name, "removed": True, **taken})
        return
    _say(f"{name}: removed")
    _say_where(taken, name, data_dir, "out")


@people_app.command("list")
def list_(data_dir: DataDir = Path(".baton"), as_json: Json = False) -> None:
    """The people of the stack, each with its credentials file."""
    from baton.stack.people import People

    people = People(data_dir)
    try:
        names = people.names()
    except ValueError as exc:
        fail(str(exc), code=2)
    if as_json:
        print_json([{"person": n, "auth_file": str(people.auth_file(n))} for n in names])
        return
    for n in names:
        _say(f"{n}\t{people.auth_file(n)}")
    if not names:
        _say(f"no people on {data_dir} (`baton people add NAME`)")


def _apply(
    stack: dict[str, Any] | None, name: str, people: People, *, want: str, creds: Credentials
) -> dict[str, Any]:
    """Have the running stack reload its people, and wait until `creds` log in at every
    hub node (`want` "in") or are refused at every one ("out"). What happened, for the
    output: `stack` "down", "no-auth" or "up"."""
    import os
    import signal

    if stack is None:
        return {"stack": "down"}
    if not stack.get("auth", True):
        return {"stack": "no-auth"}
    try:
        os.kill(int(stack["pids"]["supervisor"]), signal.SIGHUP)
    except ProcessLookupError:
        return {"stack": "down"}
    urls = [u for u in str(stack["nats_url"]).split(",") if u]
    if not run(lambda: _until(urls, creds, want)):
        where = people.root.parent
        fail(
            f"the stack on {where} did not let {name} {want} within {TAKE_S:g} s: see "
            f"`baton up`'s output and {where / 'nats'}'s nats-server.log",
            code=1,
        )
    return {"stack": "up"}


async def _until(urls: list[str], creds: Credentials, want: str) -> bool:
    """Whether, within `TAKE_S`, `creds` log in at every one of `urls` (`want` "in") or
    are refused at every one ("out") — a refusal, not a server that does not answer."""
    import asyncio

    wanted = "ok" if want == "in" else "refused"
    deadline = asyncio.get_running_loop().time() + TAKE_S
    while True:
        said = [await _login(u, creds) for u in urls]
        if all(s == wanted for s in said):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.1)


async def _login(url: str, creds: Credentials) -> str:
    """What the server at `url` makes of `creds`: "ok", "refused" (its word, `Authorization
    Violation`) or "unreachable"."""
    import asyncio

    import nats

    from shared.credentials import options_for

    async def quiet(exc: Exception) -> None:
        """Refusals are what is being asked about, not news."""

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                error_cb=quiet, **options_for(creds),
            ),
            3,
        )  # fmt: skip
    except Exception as exc:
        return "refused" if "authorization violation" in str(exc).lower() else "unreachable"
    await nc.close()
    return "ok"


def _running(data_dir: Path) -> dict[str, Any] | None:
    """The stack running on `data_dir` (its `stack.json`), or None. `stack.json` alone is
    not proof — a stack killed by SIGKILL leaves it behind, naming a pid that may be
    another process's by now — so its lock must be held too (`baton.stack.lifecycle
    .hold_lock`). A site's stack has no people: exit 2."""
    import fcntl
    import json
    import os

    run_dir = data_dir.absolute() / "run"
    try:
        fd = os.open(run_dir / "stack.lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # no stack holds it
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    try:
        stack: dict[str, Any] = json.loads((run_dir / "stack.json").read_text())
    except (FileNotFoundError, ValueError):
        return None  # starting (it reads people.json itself once up) or stopping
    if stack.get("site"):
        fail(f"{data_dir} runs site {stack['site']}: a site has no people, the hub has", code=2)
    return stack


def _say_where(taken: dict[str, Any], name: str, data_dir: Path, want: str) -> None:
    if taken["stack"] == "up":
        _say(
            f"{name} logs in at the hub now" if want == "in"
            else f"{name} is refused at the hub now, its connections closed"
        )  # fmt: skip
    elif taken["stack"] == "no-auth":
        _say(f"the stack on {data_dir} runs without authorization: people count with it on")
    else:
        _say(f"no stack is up on {data_dir}: the next `baton up` there takes this in")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
