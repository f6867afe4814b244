"""The hub's roles: operator, submitter, dispatcher, checkpointer, reaper, trainer,
dashboard and notifier (`shared.auth` says what each may do)."""

from __future__ import annotations

from shared.auth.vocabulary import (
    ALL_KV,
    API,
    DECLARE,
    FLOW,
    GET_ARCHIVED,
    HUB_API,
    Permissions,
    consume,
    create_consumer,
    get_by_key,
    read_kv,
    read_ledger,
    trainer_publish,
    write_kv,
)
from shared.bus import names
from shared.credentials import inbox_prefix

HUB_ROLES = (
    "operator", "submitter", "dispatcher", "checkpointer", "reaper", "trainer", "dashboard",
    "notifier",
)  # fmt: skip


def hub_permissions(role: str) -> Permissions | None:
    """A hub user's permissions; None for the operator (everything)."""
    inbox = f"{inbox_prefix(role)}.>"
    p = names.PREFIX
    if role == "operator":
        return None
    if role == "submitter":
        return submitter_permissions(role)
    if role == "dispatcher":
        return Permissions(
            publish=(
                *DECLARE, f"{API}.STREAM.UPDATE.*", *FLOW,
                *consume(API, names.SUBMIT_STREAM), *consume(API, names.CANCEL_STREAM),
                *read_kv(API, *ALL_KV),
                # Run records; the pools' table it applies from its file; the scheduler's
                # usage, kept across restarts (`services/dispatcher/scheduler.py`).
                *write_kv(
                    "", names.RUNS_BUCKET, names.LIVE_BUCKET, names.POLICY_BUCKET,
                    names.POOLS_BUCKET,
                ),
                GET_ARCHIVED,
                # Holds credits as runs are accepted and resumed, reading the balances it
                # checks them against (`shared.ledger`).
                f"{p}.ledger.*.hold.>", *read_ledger(API),
                f"{API}.STREAM.MSG.GET.{names.TASKS_STREAM}",
                f"{API}.STREAM.MSG.DELETE.{names.TASKS_STREAM}",
                f"{p}.tasks.>", f"{p}.events.>", f"{p}.dlq.>", f"{p}.control.>",
                # Grants runs to sites: into each site's own work queue
                # (`services/dispatcher/delegation.py`).
                f"{p}.site.*.tasks.>",
            ),
            # Answers for each pool's queue (`baton queue`, the dashboard).
            subscribe=(inbox, names.QUEUE_ALL),
            responses=True,
        )  # fmt: skip
    if role == "checkpointer":
        return Permissions(
            publish=(
                *DECLARE, f"{API}.STREAM.UPDATE.*", *FLOW, *consume(API, names.CKPT_STREAM),
                f"{p}.events.>", f"{p}.dlq.>",
                # Where the store is, for clients (`shared.state.hub`).
                *write_kv("", names.HUB_BUCKET),
            ),
            subscribe=(inbox,),
        )  # fmt: skip
    if role == "reaper":
        work_queues = (
            names.TASKS_STREAM, names.SUBMIT_STREAM, names.CKPT_STREAM, names.CANCEL_STREAM,
        )  # fmt: skip
        return Permissions(
            publish=(
                *DECLARE, f"{API}.STREAM.UPDATE.*", *FLOW,
                *consume(API, names.ADVISORY_STREAM),
                # Takes in the records of runs granted to sites (`services/reaper/grants.py`).
                *consume(API, names.REPORTS_STREAM),
                *read_kv(API, *ALL_KV),
                *write_kv("", names.RUNS_BUCKET, names.SITES_BUCKET, names.LIVE_BUCKET),
                # Frees the leases of a revoked machine's runs (`services/reaper/revocations.py`).
                *read_kv(API, names.MACHINES_BUCKET), *write_kv("", names.LEASES_BUCKET),
                # Settles ended runs' holds, once each (`services/reaper/billing.py`).
                f"{p}.ledger.*.settle.>", *read_ledger(API),
                # Retires ended runs into the archive (`shared.state.runs`).
                GET_ARCHIVED, f"{p}.archive.>",
                *(f"{API}.STREAM.MSG.GET.{s}" for s in (*work_queues, names.EVENTS_STREAM)),
                *(f"{API}.STREAM.MSG.DELETE.{s}" for s in work_queues),
                # Reads a finished run's events for its goodput (`services/reaper/accounts.py`)
                # through an ordered consumer (`shared.bus.history`).
                *create_consumer(API, names.EVENTS_STREAM),
                f"{API}.CONSUMER.DELETE.{names.EVENTS_STREAM}.>",
                # Naks a task delivery whose holder's lease expired (`shared.state.handover`).
                f"$JS.ACK.{names.TASKS_STREAM}.>",
                f"{p}.tasks.>", f"{p}.events.>", f"{p}.dlq.>", f"{p}.control.>",
            ),
            # Hears the hub trainers' pulses (`services/reaper/silences.py`).
            subscribe=(inbox, names.HELLO_ALL, names.PULSE_ALL),
        )  # fmt: skip
    if role == "trainer":
        return Permissions(
            publish=trainer_publish(API, "", ""),
            subscribe=(inbox, f"{p}.control.>", f"{p}.events.>", names.ALIVE_ALL),
        )
    if role == "dashboard":
        return dashboard_permissions()
    if role == "notifier":
        return notifier_permissions()
    raise ValueError(f"no such role at the hub: {role!r}")


def notifier_permissions() -> Permissions:
    """The notifier (`services/notifier`) takes the events it tells of from its own durable
    consumer of the events stream — created, bound, fetched and acked by its name, nothing
    else of the stream — reads run records by key (a run's pool and name) and the sites
    bucket, keeps its marks and sites' cut-offs in its own bucket, and dead-letters a
    notification a receiver refused. It publishes no event, record, task or command."""
    api, events, me = API, names.EVENTS_STREAM, names.NOTIFIER_CONSUMER
    return Permissions(
        publish=(
            *DECLARE, f"{api}.STREAM.UPDATE.*", *FLOW,
            f"{api}.CONSUMER.CREATE.{events}.{me}", f"{api}.CONSUMER.CREATE.{events}.{me}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{events}.{me}", f"{api}.CONSUMER.INFO.{events}.{me}",
            f"{api}.CONSUMER.MSG.NEXT.{events}.{me}", f"$JS.ACK.{events}.{me}.>",
            *get_by_key(api, names.RUNS_BUCKET), GET_ARCHIVED,
            *read_kv(api, names.SITES_BUCKET),
            *get_by_key(api, names.ALERTS_BUCKET), *write_kv("", names.ALERTS_BUCKET),
            names.dlq_subject("notifier"),
        ),
        subscribe=(f"{inbox_prefix('notifier')}.>",),
    )  # fmt: skip


DASHBOARD_REPLAYS = tuple(
    f"{names.PREFIX}.{k}.>" for k in ("submit", "tasks", "calls", "ckpt", "cancel")
)
"""The hub's work queues, whose consumers dead-letter what they cannot take: where the
dashboard may replay a dead letter to (and submit a fork), and all it may publish but its
steering requests (`baton.steer.>`)."""


def dashboard_permissions() -> Permissions:
    """The dashboard reads what its pages show and does its page's actions, nothing else: it
    reads the runs, workers and sites buckets, archived records by run id, a run's events
    and output (consumers filtered in the API subject, `baton/client/reader.py`), streams' info
    and consumer lists, dead letters by sequence; a replay re-publishes a letter to its work
    queue (`DASHBOARD_REPLAYS`) and deletes it, and a fork is a submission to the same
    queues. It may steer a run — pause, resume, roll back, checkpoint now — by a request on
    `baton.steer.<run>` that the dispatcher carries out, and drain and undrain a trainer
    (read and write the drains bucket by key, `shared.state.drains`); it sends trainers no
    command (`baton.control.>`: a drain is read at the trainer's next heartbeat). No
    record, lease, event or stream write. A replay is a submission or a task sent again:
    keep these credentials as the operator's."""
    api, p = API, names.PREFIX
    return Permissions(
        publish=(
            *FLOW,
            *read_kv(api, names.RUNS_BUCKET, names.WORKERS_BUCKET, names.SITES_BUCKET),
            GET_ARCHIVED,
            f"{api}.CONSUMER.CREATE.{names.EVENTS_STREAM}.*.{p}.events.>",
            f"{api}.CONSUMER.DELETE.{names.EVENTS_STREAM}.*",
            f"{api}.CONSUMER.CREATE.{names.LOGS_STREAM}.*.{p}.logs.>",
            f"{api}.CONSUMER.DELETE.{names.LOGS_STREAM}.*",
            *(f"{api}.STREAM.INFO.{s}" for s in names.ALL_STREAMS),
            *(f"{api}.CONSUMER.LIST.{s}" for s in names.ALL_STREAMS),
            f"{api}.STREAM.MSG.GET.{names.DLQ_STREAM}",
            f"{api}.STREAM.MSG.DELETE.{names.DLQ_STREAM}",
            *DASHBOARD_REPLAYS,
            names.STEER_ALL,
            *get_by_key(api, names.DRAINS_BUCKET),
            *write_kv("", names.DRAINS_BUCKET),
            # The queue page: the scheduler's answer, the pools' table, the credits.
            names.QUEUE_ALL, *get_by_key(api, names.POLICY_BUCKET), *read_ledger(api),
            # Where the checkpoint store is, when `baton ui` was given none.
            *get_by_key(api, names.HUB_BUCKET),
        ),
        subscribe=(f"{inbox_prefix('dashboard')}.>",),
    )


def submitter_permissions(user: str, site: str = "") -> Permissions:
    """A submitter may submit jobs and cancel runs as itself (its name ends the submit
    subject and starts its run ids), and read its own runs' records, events and logs —
    through reads whose API subjects name them — and nothing else."""
    p, api = names.PREFIX, HUB_API if site else API
    own_events = f"{p}.events.{user}.>"
    own_logs = f"{p}.logs.{user}.>"
    submit, cancel = f"{p}.submit.*.{user}", f"{p}.cancel.{user}.>"
    steer: tuple[str, ...] = (f"{p}.steer.{user}.>",)
    local: tuple[str, ...] = ()
    # Its credits (`baton credits`) and its pools' queues (`baton queue`), at the hub.
    # Where the checkpoint store is (`baton pull`), at the hub.
    hub_only: tuple[str, ...] = (
        *read_ledger(api, user), names.QUEUE_ALL, *get_by_key(api, names.HUB_BUCKET),
    )  # fmt: skip
    if site:
        hub_only = ()
        # Steering is carried out at the hub, where the runs' records are: a site's
        # submitter reaches it through the operator there.
        submit, cancel, steer = names.at_site(submit, site), names.at_site(cancel, site), ()
        # Its job's answer, from the site's own dispatcher, is read in the site's outbox.
        local = (
            f"{API}.CONSUMER.CREATE.{names.OUTBOX_STREAM}.*.{names.at_site(own_events, site)}",
            f"{API}.CONSUMER.DELETE.{names.OUTBOX_STREAM}.*",
        )
    return Permissions(
        publish=(
            submit, cancel, *steer, f"{api}.INFO", *FLOW,
            f"{api}.STREAM.INFO.KV_{names.RUNS_BUCKET}",
            f"{api}.DIRECT.GET.KV_{names.RUNS_BUCKET}.$KV.{names.RUNS_BUCKET}.{user}.>",
            f"{api}.DIRECT.GET.{names.ARCHIVE_STREAM}.{names.archive_subject(user)}.>",
            f"{api}.CONSUMER.CREATE.{names.EVENTS_STREAM}.*.{own_events}",
            f"{api}.CONSUMER.DELETE.{names.EVENTS_STREAM}.*",
            f"{api}.CONSUMER.CREATE.{names.LOGS_STREAM}.*.{own_logs}",
            f"{api}.CONSUMER.DELETE.{names.LOGS_STREAM}.*", *local, *hub_only,
        ),
        subscribe=(f"{inbox_prefix(user.replace('-', '_'))}.>",),
    )  # fmt: skip
