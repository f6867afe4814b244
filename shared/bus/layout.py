"""The streams and KV buckets, defined once as code: the hub's, and a site's (its outbox,
its work queue, the copies it sources from the hub). `shared.bus.streams` applies them."""

from __future__ import annotations

from nats.js.api import (
    DiscardPolicy,
    ExternalStream,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)

from shared.bus import names

DAY_S = 86400.0


DUPLICATE_WINDOW_S = 120.0


LEASE_MARKER_TTL_S = 1.0


MAX_MSG_BYTES = 1024 * 1024


HUB_API = f"$JS.{names.HUB_DOMAIN}.API"


def _work_queue(name: str, subject: str | list[str], description: str) -> StreamConfig:
    return StreamConfig(
        name=name,
        description=description,
        subjects=[subject] if isinstance(subject, str) else subject,
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        max_age=7 * DAY_S,
        max_msg_size=MAX_MSG_BYTES,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


def _history(
    name: str,
    subject: str | list[str],
    description: str,
    max_bytes: int = 2 * 1024**3,
    allow_msg_ttl: bool | None = None,
) -> StreamConfig:
    return StreamConfig(
        name=name,
        description=description,
        subjects=[subject] if isinstance(subject, str) else subject,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=30 * DAY_S,
        max_bytes=max_bytes,
        max_msg_size=MAX_MSG_BYTES,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_msg_ttl=allow_msg_ttl,
    )


def _archive() -> StreamConfig:
    # One message per run (the newest replaces any earlier copy), read by subject; no age
    # limit: an ended run stays readable until the archive's size limit drops the oldest.
    return _newest_per_key(
        names.ARCHIVE_STREAM, "Ended runs' records, once they left the runs bucket",
        16 * 1024**3, subjects=[names.ARCHIVE_ALL],
    )  # fmt: skip


def _newest_per_key(
    name: str,
    description: str,
    max_bytes: int,
    *,
    subjects: list[str] | None = None,
    sources: list[StreamSource] | None = None,
) -> StreamConfig:
    """Records read by subject, the newest of each kept (on file, up to `max_bytes`)."""
    return StreamConfig(
        name=name,
        description=description,
        subjects=subjects,
        sources=sources,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msgs_per_subject=1,
        max_bytes=max_bytes,
        max_msg_size=MAX_MSG_BYTES,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
    )


def _ledger() -> StreamConfig:
    # Append-only and write-once: one message per subject, a second refused (10077), so an
    # entry is applied once whoever writes it and however often (`shared.ledger.book`). No
    # age limit: a balance is the sum of every entry of its owner. Deletes and purges are
    # refused by the server (10057, 10110), whoever asks: that money moves once is a rule
    # of the stream, not only of the code — and, once set, no configuration takes it back.
    return StreamConfig(
        name=names.LEDGER_STREAM,
        description="Credits: top-ups, holds and settlements, each written once",
        subjects=[names.LEDGER_ALL],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        max_msgs_per_subject=1,
        max_msg_size=MAX_MSG_BYTES,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
        deny_delete=True,
        deny_purge=True,
    )


def stream_configs() -> list[StreamConfig]:
    return [
        _work_queue(names.SUBMIT_STREAM, names.SUBMIT_ALL, "Job submissions, per pool"),
        _work_queue(
            names.TASKS_STREAM,
            [names.TASKS_ALL, names.CALLS_ALL],
            "Dispatched runs, and groups' calls for ranks, per pool and run",
        ),
        _work_queue(names.CKPT_STREAM, names.CKPT_ALL, "Checkpoint commit requests"),
        _work_queue(
            names.CANCEL_STREAM,
            [names.CANCEL_ALL, names.STEER_ALL],
            "Requests about a run: cancels, and operators' steering, per run",
        ),
        _history(names.EVENTS_STREAM, names.EVENTS_ALL, "Run lifecycle events"),
        _history(names.DLQ_STREAM, names.DLQ_ALL, "Dead letters, each with its reason"),
        _history(names.LOGS_STREAM, names.LOGS_ALL, "Entry points' stdout and stderr, per run"),
        # Advisories are published on core NATS only; capturing them makes "this message
        # used up its deliveries" durable until the reaper has dealt with it.
        _work_queue(
            names.ADVISORY_STREAM,
            names.MAX_DELIVERIES_ADVISORIES,
            "JetStream max-deliveries advisories for Baton's consumers",
        ),
        _archive(),
        _ledger(),
        # Sourced from each site's runs bucket (`shared.bus.sourcing`), taken in by the
        # reaper's reconciler: a work queue, so each report is taken in once.
        _work_queue(
            names.REPORTS_STREAM, names.REPORTS_ALL, "Sites' records of the runs granted to them"
        ),
    ]


def site_stream_configs(site: str, hub_api: str = HUB_API) -> list[StreamConfig]:
    """The streams in a site's own JetStream domain. The outbox keeps what the site sends to
    the hub until the hub has sourced it: a limits stream (the hub reads it, nobody acks
    it), big and long-lived enough to ride out a long WAN outage. Per-message TTLs are on
    for heartbeats, which must not reach the hub long after they stopped being true."""
    return [
        _history(
            names.OUTBOX_STREAM,
            [names.site_root(site, kind) for kind in names.SITE_OUTBOX_KINDS],
            f"What site {site} sends to the hub; sourced by the hub's streams",
            max_bytes=4 * 1024**3,
            allow_msg_ttl=True,
        ),
        _work_queue(
            names.CKPT_STREAM,
            names.site_root(site, "ckpt"),
            f"Checkpoint commit requests of site {site}'s trainers",
        ),
        # Jobs submitted at the site, taken by its own dispatcher (`services/dispatcher/site.py`).
        _work_queue(
            names.SUBMIT_STREAM, names.site_root(site, "submit"), f"Jobs submitted at site {site}"
        ),
        # The tasks the hub delegated to the site (`services/dispatcher/delegation.py`):
        # held here, so a site cut off from the hub still has runs to start.
        # With the calls for the ranks of the groups granted to it (`services/trainer/group.py`).
        _work_queue(
            names.TASKS_STREAM,
            [names.site_root(site, "tasks"), names.site_root(site, "ranks")],
            f"Runs the hub granted to site {site}, and their groups' calls, per pool",
        ),
        _hub_runs(site, hub_api),
    ]


def _hub_runs(site: str, hub_api: str) -> StreamConfig:
    """The hub's run records, live and archived, as the site last saw them: sourced from the
    hub's runs bucket and archive (`hub_api`, the hub's domain) while the link is up, newest
    per run. A site's dispatcher cut off from the hub reads a run id here, so a job the hub
    ran before is not run again at the site (`services/dispatcher/site.py`). Records keep
    their hub subjects (`$KV.baton_runs.<run>`, `baton.archive.<run>`) and are read by
    subject, as at the hub. The hub delivers them under the site's own subjects
    (`names.from_hub`), which are all its link lets in of them (`shared.auth.site_link`)."""
    hub = ExternalStream(api=hub_api, deliver=names.from_hub(site))
    sources = [
        StreamSource(name=f"KV_{names.RUNS_BUCKET}", external=hub),
        StreamSource(name=names.ARCHIVE_STREAM, external=hub),
    ]
    return _newest_per_key(
        names.HUB_RUNS_STREAM, "The hub's run records (live and archived), newest per run",
        4 * 1024**3, sources=sources,
    )  # fmt: skip


def hub_machines(site: str, hub_api: str = HUB_API) -> StreamConfig:
    """The hub's machine and token records as the site last saw them (`shared.machines`),
    sourced while the link is up, newest per key: a site that admits machines answers its
    leaf node's logins from it, through a cut too (`services/registrar`). Declared by the
    site's registrar; read by subject (`$KV.baton_machines.machine.<id>`), as at the hub."""
    hub = ExternalStream(api=hub_api, deliver=names.from_hub(site))
    return _newest_per_key(
        names.HUB_MACHINES_STREAM, "The hub's machine and token records, newest per key",
        256 * 1024**2, sources=[StreamSource(name=f"KV_{names.MACHINES_BUCKET}", external=hub)],
    )  # fmt: skip


def site_kv_configs(site: str) -> list[KeyValueConfig]:
    """The records, leases and groups of the runs granted to `site`, in its own domain: the
    site starts, leases, forms and completes them while cut off (`shared.state.grants`). The
    runs bucket keeps each run's newest record only: it is what the hub sources and takes
    in."""
    return [
        KeyValueConfig(
            bucket=names.site_runs_bucket(site), history=1, direct=True,
            description=f"Records of the runs granted to site {site}", ttl=30 * DAY_S,
        ),
        KeyValueConfig(
            bucket=names.site_leases_bucket(site), history=1, direct=True,
            description=f"Leases of the runs granted to site {site}",
            limit_marker_ttl=LEASE_MARKER_TTL_S,
        ),
        KeyValueConfig(
            bucket=names.site_groups_bucket(site), history=1, direct=True,
            description=f"Groups of the runs granted to site {site}",
        ),
    ]  # fmt: skip


def kv_configs() -> list[KeyValueConfig]:
    return [
        # Direct gets name the key in the API subject, which lets a submitter's permissions
        # allow reading its own runs' records and no other's (`shared.auth`).
        KeyValueConfig(bucket=names.RUNS_BUCKET, history=5, description="Run records", direct=True),
        # No bucket TTL: each lease carries its own per-message TTL, enforced by the
        # server's clock, so lease expiry never depends on clocks agreeing across hosts.
        # Direct gets too: trainers may read a lease only by naming its key (`shared.auth`).
        # A lease that expires leaves a marker for a second (the shortest the server
        # allows): the event the reaper hands a run over on (`services/reaper/lapses.py`).
        KeyValueConfig(
            bucket=names.LEASES_BUCKET,
            history=1,
            description="Run leases",
            direct=True,
            limit_marker_ttl=LEASE_MARKER_TTL_S,
        ),
        KeyValueConfig(bucket=names.WORKERS_BUCKET, history=1, description="Trainer heartbeats"),
        KeyValueConfig(bucket=names.POOLS_BUCKET, history=1, description="Measured pool speeds"),
        KeyValueConfig(bucket=names.SITES_BUCKET, history=1, description="Sites and their links"),
        KeyValueConfig(bucket=names.LIVE_BUCKET, history=1, description="Runs not yet retired"),
        # Keys carry their own short TTL, renewed by their writers: a trainer's silence shows
        # as its key gone (`services/trainer/group.py`). Direct gets for the members' reads.
        KeyValueConfig(
            bucket=names.GROUPS_BUCKET, history=1, description="Groups of ranks", direct=True
        ),
        # Where the checkpoint store is, read by key by clients (`shared.state.hub`).
        KeyValueConfig(
            bucket=names.HUB_BUCKET, history=1, description="What the hub says of itself",
            direct=True,
        ),
        # Join tokens and machines, read by key by the registrar at every connection of a
        # machine; history 1: a token's use and a machine's revocation are CAS writes.
        KeyValueConfig(
            bucket=names.MACHINES_BUCKET, history=1, description="Machines and join tokens",
            direct=True,
        ),
        # The pools' table in force, one key, read by key by every service (`shared.state.policy`).
        KeyValueConfig(
            bucket=names.POLICY_BUCKET, history=10, description="The pools' table", direct=True
        ),
        # Written by operators, read by key by the trainer each names (`shared.state.drains`).
        KeyValueConfig(
            bucket=names.DRAINS_BUCKET, history=1, description="Drained trainers", direct=True
        ),
        # The notifier's marks (each written once, with a per-key TTL that outlives the
        # events stream's age) and sites' cut-off episodes; read by key (`services/notifier`).
        KeyValueConfig(
            bucket=names.ALERTS_BUCKET, history=1, description="Notifications sent", direct=True
        ),
    ]
