"""A stack's whole history as one plain value, read once (`shared.history.collect`) and
checked as often as wanted (`shared.history.verify`).

Invariant: a `History` is only what the stack stored — the hub's events in stream order with
the server's stamps, the run records (live and archived), the leases, the ledger's entries
under their subjects, and each run's checkpoints as the store holds them — never anything
derived from it: every conclusion is drawn by the checks, from this value alone, so a test
can build one by hand with any fault planted in it.
"""

from __future__ import annotations

import msgspec

from shared.contracts.checkpoints import Manifest, Pointer, Rewound
from shared.contracts.events import Event
from shared.contracts.ledger import Entry
from shared.contracts.records import RunRecord


class Logged(msgspec.Struct, frozen=True, kw_only=True):
    """One stored event: its sequence in `BATON_EVENTS` and the hub server's stamp of it."""

    seq: int
    stamp: float
    """Seconds since the epoch on the hub server's clock: when the hub stored it."""
    event: Event


class Posted(msgspec.Struct, frozen=True, kw_only=True):
    """One ledger entry, under the subject it was stored at (its identity)."""

    seq: int
    subject: str
    entry: Entry


class LeaseHeld(msgspec.Struct, frozen=True, kw_only=True):
    """A lease in `baton_leases` as it stands: its key (the run id, suffixed with a MAC
    under a lease secret), holder, the token its value names (0 in the acquiring write,
    whose token is its revision under the run's epoch) and its revision."""

    key: str
    worker: str
    token: int
    revision: int


class Checkpoints(msgspec.Struct, frozen=True, kw_only=True):
    """One run's part of the store: its `latest`, every manifest stored (by key), and its
    rollbacks' notes (`runs/<run>/rewinds/`)."""

    run_id: str
    latest: Pointer | None = None
    manifests: dict[str, Manifest] = {}
    rewinds: list[Rewound] = []

    def chain(self) -> list[str]:
        """Manifest keys reachable from `latest` through `previous`, newest first; the walk
        stops where a manifest is not stored (retention cut the chain) or would repeat."""
        keys: list[str] = []
        key = self.latest.checkpoint if self.latest is not None else None
        while key is not None and key in self.manifests and key not in keys:
            keys.append(key)
            key = self.manifests[key].previous
        return keys


class TopUpId(msgspec.Struct, frozen=True, kw_only=True):
    """A top-up some writer was told was stored (`baton credits topup` answered)."""

    owner: str
    id: str


class Sighting(msgspec.Struct, frozen=True, kw_only=True):
    """A training process of `run_id` seen alive at `alive_at`, on the hub server's clock
    (an observer on the server's host reads it off its own wall clock)."""

    run_id: str
    pid: int
    alive_at: float


class History(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a stack stored about its runs (see the module's invariant)."""

    events: list[Logged] = []
    """`BATON_EVENTS`, in stream order."""
    records: dict[str, RunRecord] = {}
    """KV `baton_runs`: live runs and runs ended within `BATON_RETAIN_ENDED`."""
    archived: dict[str, RunRecord] = {}
    """`BATON_ARCHIVE`: every retired run's record."""
    live: list[str] = []
    """KV `baton_live`: the runs the control plane sweeps."""
    leases: list[LeaseHeld] = []
    ledger: list[Posted] = []
    """`BATON_LEDGER`, in stream order."""
    checkpoints: dict[str, Checkpoints] = {}
    acknowledged_topups: list[TopUpId] = []
    """Top-ups whose writers were told they were stored; filled in by whoever knows (a test)."""
    sightings: list[Sighting] = []
    """Training processes seen alive; filled in by whoever can look (a test)."""
    unreadable: int = 0
    """Stored messages this version could not decode (a newer Baton's): left out."""

    def record(self, run_id: str) -> RunRecord | None:
        """The run's record: the runs bucket's, else the archive's."""
        return self.records.get(run_id) or self.archived.get(run_id)

    def run_ids(self) -> list[str]:
        """Every run the history names, sorted."""
        named = {lg.event.run_id for lg in self.events}
        return sorted(named | set(self.records) | set(self.archived) | set(self.checkpoints))

    def events_of(self, run_id: str) -> list[Logged]:
        return [lg for lg in self.events if lg.event.run_id == run_id]


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """An invariant the history breaks: its stable short id, a sentence, what is involved."""

    invariant: str
    detail: str
    runs: list[str] = []
    entries: list[str] = []
    """Events (`event <seq>`), ledger subjects, manifest keys, pids: whatever shows it."""
