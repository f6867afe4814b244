"""The people of a stack: each its own submitter user at the hub, added and removed while the
stack runs (`baton people`, `baton up --submitter`).

A person is a submitter (`shared.auth.submitter_permissions`): it may submit only on
`baton.submit.<pool>.<itself>` and read only its own runs, whose ids start with its name. The
set lives in `<data>/auth/people.json`, a list of names, and each person's password in the
stack's vault beside it (`<data>/auth/<name>.env`, the file its CLI logs in with). `baton
up` builds the hub's authorization from that set (`StackOptions.submitters`) and, on
SIGHUP, builds it again and has every hub node reload it: people come and go without a
restart, and the servers close a removed person's connections themselves.

Every change to the set holds `<data>/auth/people.lock`, so two `baton people` commands at
once never lose one another's change, and `baton up` never reads a person whose
credentials are half made or half removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from shared.auth import HUB_ROLES, SITE_ROLES
from shared.credentials import Credentials, Vault, inbox_prefix

PERSON = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
PEOPLE_FILE = "people.json"


def check_person(name: str) -> str:
    """`name` if it can be a person's, else ValueError saying the rule. A person's name is
    a NATS subject token that owns runs (`<name>.r…`), so it must be one token of plain
    characters, and must not be a user the stack already has: a role, a site's link
    (`site-<site>`), nor one of a site's users (`<site>-<role>`), whose runs and reply inbox
    (`_INBOX_<site>_<role>`) it would share."""
    if not PERSON.match(name):
        raise ValueError(
            f"{name!r} cannot name a person: 1 to 32 characters, lowercase letters, digits, "
            "'-' and '_', starting with a letter"
        )
    roles = sorted({*HUB_ROLES, *SITE_ROLES})
    if name in roles:
        raise ValueError(f"{name!r} is a role of the stack's own, not a person's name")
    if name.startswith("site-"):
        raise ValueError(f"{name!r} cannot name a person: 'site-' starts the sites' links")
    if name.startswith(("m-", "join-")):
        raise ValueError(
            f"{name!r} cannot name a person: 'm-' and 'join-' start machines' users "
            "(docs/machines.md)"
        )
    if any(name.endswith((f"-{r}", f"_{r}")) for r in SITE_ROLES):
        raise ValueError(
            f"{name!r} cannot name a person: names ending in -{{role}} or _{{role}} "
            f"({', '.join(SITE_ROLES)}) are a site's users"
        )
    return name


def inbox_of(name: str) -> str:
    """The reply prefix a person's permissions allow (`shared.auth.submitter_permissions`):
    `-` and `_` give the same one, so two people may not differ by those alone."""
    return inbox_prefix(name.replace("-", "_"))


class People:
    """The people of the stack under `data_dir`, and their credentials."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir).absolute() / "auth"
        self.path = self.root / PEOPLE_FILE
        self.vault = Vault(self.root)

    def auth_file(self, name: str) -> Path:
        """The person's credentials (`NATS_USER`/`NATS_PASSWORD`), as `Vault.get` writes
        them: what its CLI is given (`--auth-file`, `NATS_AUTH_FILE`)."""
        return self.root / f"{name}.env"

    def names(self) -> list[str]:
        """The people, sorted; ValueError if the file is not a list of valid names."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except ValueError as exc:
            raise ValueError(f"{self.path}: not JSON ({exc})") from None
        if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
            raise ValueError(f"{self.path}: not a list of names")
        for name in raw:
            try:
                check_person(name)
            except ValueError as exc:
                raise ValueError(f"{self.path}: {exc}") from None
        return sorted(set(raw))

    def check(self, name: str, besides: Iterable[str] = ()) -> str:
        """`name` if it could be added now (it may already be a person), with `besides` as
        well, else ValueError."""
        check_person(name)
        others = {*self.names(), *besides} - {name}
        if clash := sorted(n for n in others if inbox_of(n) == inbox_of(name)):
            raise ValueError(
                f"{name!r} and the person {clash[0]!r} would share a reply inbox "
                f"({inbox_of(name)}): '-' and '_' are one there"
            )
        return name

    def add(self, name: str) -> bool:
        """Add `name` with its credentials (generated, kept from then on); False if it was
        a person already."""
        with self.locked():
            self.check(name)
            self.vault.get(name)  # before the name: whoever reads the name finds its password
            people = self.names()
            if name in people:
                return False
            self._write([*people, name])
            return True

    def remove(self, name: str) -> Credentials | None:
        """Remove `name` and its credential file; the credentials it had (None if it was
        no person here), so a caller can check that they no longer log in."""
        with self.locked():
            people = self.names()
            if name not in people:
                return None
            creds = self.vault.get(name)
            self._write([n for n in people if n != name])
            self.auth_file(name).unlink()
            return creds

    def adding(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Every person once `names` are added (`baton up --submitter`)."""
        for name in names:
            self.add(name)
        return tuple(self.names())

    def changed_from(self, names: tuple[str, ...]) -> bool:
        """Whether the people are no longer `names` (an unreadable file counts as a change:
        the reload says what is wrong with it)."""
        try:
            return tuple(self.names()) != names
        except ValueError:
            return True

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the people's lock (`<auth>/people.lock`, owner-only) for a change or a read
        of names and credentials together."""
        self.vault.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        fd = os.open(self.root / "people.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # which drops the lock

    def _write(self, people: list[str]) -> None:
        """Atomically (a temporary file, then a rename), owner-only from its first byte."""
        tmp = self.path.with_name(f"{PEOPLE_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(sorted(people), indent=2) + "\n")
        os.replace(tmp, self.path)
