"""Who a process is on NATS: generated passwords kept owner-only (`Vault`), the files and
environment variables credentials come from, and the client options they make — the user
and its own reply prefix (`_INBOX_<user>`), which the servers' permissions expect
(`shared.auth` says what each user may do).

Passwords are never in a spec, an event, a log or a URL that gets logged: services get
them in their environment, the CLI from a file (`NATS_AUTH_FILE`) or the environment.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


class Credentials(msgspec.Struct, frozen=True):
    user: str
    password: str


class Vault:
    """Generated passwords, one owner-only file per user under `root` (mode 0700)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def secret(self, name: str, make: Callable[[], str] | None = None) -> Path:
        """A generated secret's file (`<name>.secret`), created on first use: `make()`'s,
        or 32 random bytes, URL-safe."""
        path = self.root / f"{name}.secret"
        if not path.exists():
            self._create(path, (make() if make else secrets.token_urlsafe(32)) + "\n")
        return path

    def get(self, user: str) -> Credentials:
        """The user's credentials, generated on first use and kept from then on."""
        path = self.root / f"{user}.env"
        self._create(path, f"NATS_USER={user}\nNATS_PASSWORD={secrets.token_urlsafe(24)}\n")
        return read_env_file(path)

    def _create(self, path: Path, text: str) -> None:
        """Write `text` to `path` unless it exists; owner-only from its first byte (the mode
        is set at creation, never after)."""
        if path.exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)


def read_env_file(path: Path) -> Credentials:
    """`NATS_USER=…` / `NATS_PASSWORD=…` lines, as `Vault` writes them."""
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    try:
        return Credentials(user=values["NATS_USER"], password=values["NATS_PASSWORD"])
    except KeyError as exc:
        raise ValueError(f"{path}: no {exc.args[0]}") from None


def lease_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The hub's lease secret (`BATON_LEASE_SECRET`, or a file named by
    `BATON_LEASE_SECRET_FILE`); None keys leases by run id."""
    env = os.environ if env is None else env
    if env.get("BATON_LEASE_SECRET"):
        return env["BATON_LEASE_SECRET"].encode()
    if env.get("BATON_LEASE_SECRET_FILE"):
        return Path(env["BATON_LEASE_SECRET_FILE"]).read_bytes().strip()
    return None


def departures_credentials(env: Mapping[str, str] | None = None) -> Credentials | None:
    """The reaper's system-account user (`shared.auth.DEPARTURES_USER`), if the environment
    gives it: `BATON_DEPARTURES_AUTH_FILE` (a file as `Vault` writes), or
    `BATON_DEPARTURES_USER` with `BATON_DEPARTURES_PASSWORD`."""
    env = os.environ if env is None else env
    if env.get("BATON_DEPARTURES_AUTH_FILE"):
        return read_env_file(Path(env["BATON_DEPARTURES_AUTH_FILE"]))
    if env.get("BATON_DEPARTURES_USER"):
        return Credentials(
            user=env["BATON_DEPARTURES_USER"], password=env.get("BATON_DEPARTURES_PASSWORD", "")
        )
    return None


def client_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nats-py options for the credentials in the environment: `NATS_USER` with
    `NATS_PASSWORD` (or `NATS_PASSWORD_FILE`), or `NATS_AUTH_FILE` (a file as `Vault`
    writes). The inbox prefix follows the user, as the servers' permissions expect."""
    env = os.environ if env is None else env
    creds: Credentials | None = None
    if env.get("NATS_AUTH_FILE"):
        creds = read_env_file(Path(env["NATS_AUTH_FILE"]))
    elif env.get("NATS_USER"):
        password = env.get("NATS_PASSWORD", "")
        if not password and env.get("NATS_PASSWORD_FILE"):
            password = Path(env["NATS_PASSWORD_FILE"]).read_text().strip()
        creds = Credentials(user=env["NATS_USER"], password=password)
    return options_for(creds) if creds else {}


def options_for(creds: Credentials) -> dict[str, Any]:
    return {
        "user": creds.user,
        "password": creds.password,
        "inbox_prefix": inbox_prefix(creds.user.replace("-", "_")),
    }
