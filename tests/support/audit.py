"""What a stack's logs must never say, read after every end-to-end test.

A request the servers refuse for want of a permission looks, to the nats-py client, like a
slow server: the server logs a `Violation` and the client sees only `nats: timeout`
(docs/nats.md). So a role that lacks what its code calls is found in the logs, not in the
test's assertions — the reaper's sweeps once failed that way in every default deployment
while the whole suite passed. Every stack the tests start is audited when it stops:

* no nats-server (hub node or site leaf) logs a permission or authorization violation;
* no service logs a failed sweep or a JetStream API timeout.

A test that cuts links, stops servers or wins elections on purpose may see timeouts that
are the point of the test: it says so with `Audit.allow` (a pattern and why), and only the
service-side check is relaxed — a server's `Violation` is never allowed that way.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

SERVER_FORBIDDEN = re.compile(r"Violation")
"""`Publish Violation`, `Subscription Violation`, `Authorization Violation`."""
SERVICE_FORBIDDEN = re.compile(r"sweep failed|nats: timeout|JetStream API timeout")
MAX_SHOWN = 12


class Finding(msgspec.Struct, frozen=True):
    log: str
    line: str


class Audit:
    """The logs under one stack's directory (services' `logs/*.log`, every nats-server's
    `nats-server.log`, the hub's and its sites')."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.allowed: list[tuple[re.Pattern[str], str]] = []
        self.server_allowed: list[tuple[re.Pattern[str], str]] = []

    def allow(self, pattern: str, why: str) -> None:
        """Service log lines matching `pattern` are what this test causes on purpose."""
        self.allowed.append((re.compile(pattern), why))

    def allow_server(self, pattern: str, why: str) -> None:
        """A server log line matching `pattern` is this test's own doing — a client it
        starts with wrong credentials or too few rights to prove they are refused. Never
        for a service's own role."""
        self.server_allowed.append((re.compile(pattern), why))

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        for path in sorted(self.root.rglob("*.log")):
            server = path.name == "nats-server.log"
            forbidden = SERVER_FORBIDDEN if server else SERVICE_FORBIDDEN
            allowed = self.server_allowed if server else self.allowed
            for line in path.read_text(errors="replace").splitlines():
                if forbidden.search(line) and not any(p.search(line) for p, _ in allowed):
                    found.append(Finding(str(path.relative_to(self.root)), line.strip()))
        return found

    def check(self) -> None:
        """Fail naming what the logs said, if they said anything forbidden."""
        found = self.findings()
        if found:
            shown = "\n".join(f"  {f.log}: {f.line[:300]}" for f in found[:MAX_SHOWN])
            more = f"\n  … and {len(found) - MAX_SHOWN} more" if len(found) > MAX_SHOWN else ""
            raise AssertionError(
                f"the stack's logs say something no run may cause ({len(found)} line(s)): a "
                f"permission refused, a failed sweep or a JetStream API timeout:\n{shown}{more}"
            )
