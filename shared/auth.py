"""Who may do what on NATS: one user per role, each with allow-lists of exactly what it needs.

Whoever can publish a job can run code on a GPU, so the roles are enforced by the servers,
not by Baton's code. Every list below is an *allow* list: what is not named is denied. At the
hub:

    operator      everything (the CLI's admin commands, `baton up`'s own checks)
    submitter     submit jobs, and cancel, pause, resume, roll back or checkpoint runs as
                  itself; read its own runs' records, events and logs, and its own
                  credits (each submitter user owns the runs it submits); ask for a
                  pool's queue
    dispatcher    take submissions, cancels and steering requests; write run records;
                  publish tasks, and grant runs to sites (into each site's work queue);
                  hold credits; answer for each pool's queue (the scheduler); apply the
                  pools' table
    checkpointer  take commit requests; publish commit outcomes
    reaper        read everything it sweeps; write run records; re-publish tasks; link sites;
                  take in sites' records of the runs granted to them; settle ended
                  runs' credits
    trainer       take tasks (its consumer only); write the leases of the runs it was
                  handed, run records and heartbeats; send its pulses; publish events,
                  logs, commit requests; read drain keys by key (whether it is drained)
    dashboard     `baton ui`: read what its pages show; replay a dead letter to its work
                  queue, and submit a fork (pinning a checkpoint writes to the store, not
                  to NATS); pause, resume, roll back or checkpoint a run (steering); drain
                  and undrain trainers (the drains bucket)
    notifier      take the events it tells of (its own durable consumer only); read run
                  records and the sites bucket; write its own bucket (what it sent, sites'
                  cut-offs); dead-letter a notification a receiver refused

None but the operator may delete or purge a stream; a trainer can publish neither a task nor
a submission. At a site, the leaf node has its own users (trainer, checkpointer,
dispatcher, submitter, operator), allowed only their site's subjects and the few hub APIs
they use (the site's dispatcher reads any run record by key, to refuse running again a job
the hub knows); and the leaf's own link to the hub is a user (`site-<name>`) allowed to
carry only that traffic, so a site can touch neither another site's subjects nor the hub's
streams beyond its work.

Replies come back on a per-user inbox prefix (`_INBOX_<user>`), so no user can subscribe to
another's replies. Passwords are generated, kept in files readable by their owner only,
and handed to services in their environment — never in a spec, an event or a log.

A trainer writes leases by key, and a run's lease key is a capability: a MAC of the run id
under a secret only the hub's dispatcher and reaper hold, handed out in the run's task
(`shared.state.lease.lease_key`). Trainers may read leases only by naming a key — never list the
bucket nor read it by sequence — so a trainer can write the lease of a run it was handed and
of no other. (Run records stay writable by every trainer: any trainer of a pool may be
handed any of its runs, and every change is a compare-and-swap checked against the lease's
token, so a rogue trainer can waste a run's compute but not corrupt its checkpoints.)
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from shared.bus import names
from shared.credentials import Credentials, inbox_prefix

API = "$JS.API"
HUB_API = f"$JS.{names.HUB_DOMAIN}.API"

HUB_ROLES = (
    "operator", "submitter", "dispatcher", "checkpointer", "reaper", "trainer", "dashboard",
    "notifier",
)  # fmt: skip
SITE_ROLES = ("operator", "submitter", "checkpointer", "dispatcher", "trainer")


class Permissions(msgspec.Struct, frozen=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False
    """May answer the requests it receives (a reply to the asker's inbox, once each), which
    its publish list does not name: the dispatcher answering for a pool's queue."""


def owner_of(user: str) -> str:
    """The owner token of the runs `user` submits: none for operators (they may do
    anything anyway), else the user's name (`shared.contracts.run_id_for`)."""
    return "" if not user or user == "operator" or user.endswith("-operator") else user


def _create_consumer(api: str, stream: str) -> list[str]:
    """Create consumers of `stream`. nats-py creates a named or filtered consumer on
    `CONSUMER.CREATE.<stream>.<name>[.<filter>]`, but an unnamed one — every ordered
    consumer, `keys()`, a history read — on the bare `CONSUMER.CREATE.<stream>`: a role
    granted only the first is refused, and its client sees nothing but a timeout."""
    return [f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>"]


def _consume(api: str, stream: str) -> list[str]:
    """Bind, create and fetch from durable consumers of `stream`, and ack its messages."""
    return [
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",
        *_create_consumer(api, stream),
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def _read_kv(api: str, *buckets: str) -> list[str]:
    out = []
    for b in buckets:
        stream = f"KV_{b}"
        out += [
            f"{api}.STREAM.INFO.{stream}",
            f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>",
            # `keys()` and watches read through an ordered consumer of their own.
            *_create_consumer(api, stream),
            f"{api}.CONSUMER.INFO.{stream}.>",
            f"{api}.CONSUMER.DELETE.{stream}.>",
        ]
    return out


def _get_by_key(api: str, bucket: str) -> list[str]:
    """Read a bucket only by naming a key: no listing, no reading by sequence. The leases
    bucket is read so by trainers, whose lease keys are capabilities (`shared.state.lease`)."""
    stream = f"KV_{bucket}"
    return [f"{api}.STREAM.INFO.{stream}", f"{api}.DIRECT.GET.{stream}.$KV.{bucket}.>"]


def _write_kv(prefix: str, *buckets: str) -> list[str]:
    return [f"{prefix}$KV.{b}.>" for b in buckets]


def _read_ledger(api: str, owner: str = "*") -> list[str]:
    """Read ledger entries: one by its subject (a direct get), or an owner's in order (an
    ordered consumer filtered in the API subject on `owner`'s entries; `*`: anyone's)."""
    stream = names.LEDGER_STREAM
    if owner == "*":
        return [
            f"{api}.STREAM.INFO.{stream}", f"{api}.DIRECT.GET.{stream}.>",
            *_create_consumer(api, stream), f"{api}.CONSUMER.DELETE.{stream}.>",
        ]  # fmt: skip
    return [
        f"{api}.CONSUMER.CREATE.{stream}.*.{names.ledger_of(owner)}",
        f"{api}.CONSUMER.DELETE.{stream}.*",
    ]


_DECLARE = [f"{API}.INFO", f"{API}.STREAM.INFO.*", f"{API}.STREAM.CREATE.*"]
"""Declaring streams and buckets at start (`shared.bus.streams.ensure`): create, never delete."""
_FLOW = ["$JS.FC.>"]
"""Flow-control replies of push consumers (ordered consumers, `keys()`)."""
_ALL_KV = (
    names.RUNS_BUCKET, names.LEASES_BUCKET, names.WORKERS_BUCKET, names.POOLS_BUCKET,
    names.SITES_BUCKET, names.LIVE_BUCKET, names.GROUPS_BUCKET, names.POLICY_BUCKET,
)  # fmt: skip
_GET_ARCHIVED = f"{API}.DIRECT.GET.{names.ARCHIVE_STREAM}.>"
"""Reading an ended run's record by its run id (`shared.state.archive`)."""


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
                *_DECLARE, f"{API}.STREAM.UPDATE.*", *_FLOW,
                *_consume(API, names.SUBMIT_STREAM), *_consume(API, names.CANCEL_STREAM),
                *_read_kv(API, *_ALL_KV),
                # Run records; the pools' table it applies from its file; the scheduler's
                # usage, kept across restarts (`services/dispatcher/scheduler.py`).
                *_write_kv(
                    "", names.RUNS_BUCKET, names.LIVE_BUCKET, names.POLICY_BUCKET,
                    names.POOLS_BUCKET,
                ),
                _GET_ARCHIVED,
                # Holds credits as runs are accepted and resumed, reading the balances it
                # checks them against (`shared.ledger`).
                f"{p}.ledger.*.hold.>", *_read_ledger(API),
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
                *_DECLARE, f"{API}.STREAM.UPDATE.*", *_FLOW, *_consume(API, names.CKPT_STREAM),
                f"{p}.events.>", f"{p}.dlq.>",
                # Where the store is, for clients (`shared.state.hub`).
                *_write_kv("", names.HUB_BUCKET),
            ),
            subscribe=(inbox,),
        )  # fmt: skip
    if role == "reaper":
        work_queues = (
            names.TASKS_STREAM, names.SUBMIT_STREAM, names.CKPT_STREAM, names.CANCEL_STREAM,
        )  # fmt: skip
        return Permissions(
            publish=(
                *_DECLARE, f"{API}.STREAM.UPDATE.*", *_FLOW,
                *_consume(API, names.ADVISORY_STREAM),
                # Takes in the records of runs granted to sites (`services/reaper/grants.py`).
                *_consume(API, names.REPORTS_STREAM),
                *_read_kv(API, *_ALL_KV),
                *_write_kv("", names.RUNS_BUCKET, names.SITES_BUCKET, names.LIVE_BUCKET),
                # Frees the leases of a revoked machine's runs (`services/reaper/revocations.py`).
                *_read_kv(API, names.MACHINES_BUCKET), *_write_kv("", names.LEASES_BUCKET),
                # Settles ended runs' holds, once each (`services/reaper/billing.py`).
                f"{p}.ledger.*.settle.>", *_read_ledger(API),
                # Retires ended runs into the archive (`shared.state.runs`).
                _GET_ARCHIVED, f"{p}.archive.>",
                *(f"{API}.STREAM.MSG.GET.{s}" for s in (*work_queues, names.EVENTS_STREAM)),
                *(f"{API}.STREAM.MSG.DELETE.{s}" for s in work_queues),
                # Reads a finished run's events for its goodput (`services/reaper/accounts.py`)
                # through an ordered consumer (`shared.bus.history`).
                *_create_consumer(API, names.EVENTS_STREAM),
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
            publish=_trainer_publish(API, "", ""),
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
            *_DECLARE, f"{api}.STREAM.UPDATE.*", *_FLOW,
            f"{api}.CONSUMER.CREATE.{events}.{me}", f"{api}.CONSUMER.CREATE.{events}.{me}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{events}.{me}", f"{api}.CONSUMER.INFO.{events}.{me}",
            f"{api}.CONSUMER.MSG.NEXT.{events}.{me}", f"$JS.ACK.{events}.{me}.>",
            *_get_by_key(api, names.RUNS_BUCKET), _GET_ARCHIVED,
            *_read_kv(api, names.SITES_BUCKET),
            *_get_by_key(api, names.ALERTS_BUCKET), *_write_kv("", names.ALERTS_BUCKET),
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
            *_FLOW,
            *_read_kv(api, names.RUNS_BUCKET, names.WORKERS_BUCKET, names.SITES_BUCKET),
            _GET_ARCHIVED,
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
            *_get_by_key(api, names.DRAINS_BUCKET),
            *_write_kv("", names.DRAINS_BUCKET),
            # The queue page: the scheduler's answer, the pools' table, the credits.
            names.QUEUE_ALL, *_get_by_key(api, names.POLICY_BUCKET), *_read_ledger(api),
            # Where the checkpoint store is, when `baton ui` was given none.
            *_get_by_key(api, names.HUB_BUCKET),
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
        *_read_ledger(api, user), names.QUEUE_ALL, *_get_by_key(api, names.HUB_BUCKET),
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
            submit, cancel, *steer, f"{api}.INFO", *_FLOW,
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


_SENT = ("events", "logs", "ckpt", "dlq", "calls")
"""What a trainer publishes (at a site: on its site's subjects, into its outbox)."""


def _trainer_publish(
    api: str, kv_prefix: str, site: str, workers: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """A trainer's: its work queue, the KV it reads and writes, and what it sends home.
    `workers`: the only worker ids whose heartbeats it may write (a joined machine's); none
    named, any."""
    mine = [f"$KV.{names.WORKERS_BUCKET}.{w}" for w in workers]
    heartbeats = mine or _write_kv("", names.WORKERS_BUCKET)
    # That it is alive while it holds a run (`services/trainer/pulse.py`); whether a
    # member of its group is gone (`shared.bus.probe`).
    pulses = [names.pulse_subject(w) for w in workers] or [names.PULSE_ALL]
    pulses.append(names.ALIVE_ALL)
    return (
        f"{api}.INFO", *_FLOW, *_consume(api, names.TASKS_STREAM),
        *_read_kv(api, names.RUNS_BUCKET, names.POOLS_BUCKET, names.GROUPS_BUCKET),
        *_get_by_key(api, names.LEASES_BUCKET),
        # The pools' table in force (`shared.state.policy`).
        *_get_by_key(api, names.POLICY_BUCKET),
        # Whether it is drained (`services/trainer/drain.py`); only operators write it.
        *_get_by_key(api, names.DRAINS_BUCKET),
        *_write_kv(
            kv_prefix, names.RUNS_BUCKET, names.LEASES_BUCKET, names.POOLS_BUCKET,
            names.GROUPS_BUCKET,
        ),
        # A trainer leading a group calls for its other ranks on the work queue
        # (`services/trainer/group.py`); a site trainer's calls go through its outbox.
        *(
            [names.site_root(site, k) for k in (*_SENT, "workers")]
            if site
            else [f"{names.PREFIX}.{k}.>" for k in _SENT] + heartbeats + pulses
        ),
    )  # fmt: skip


CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
MACHINE_INBOX = "m_"
"""What every joined machine's inbox prefix starts with (`_INBOX_m_<id>`)."""
SYSTEM_USER = "system"
"""A system account's user with every right there: the registrar, asking the servers which
connections a revoked machine has and closing them (`$SYS.REQ.SERVER.*.CONNZ`, `.KICK`)."""
DEPARTURES_USER = "departures"
"""A system account's user that may only hear connections close (`DISCONNECTS`): the
reaper's second connection (`services/reaper/departures.py`)."""
DISCONNECTS = "$SYS.ACCOUNT.*.DISCONNECT"
"""The servers' advisory for every client connection that closed, whatever its account."""


def departures_permissions() -> Permissions:
    """The reaper's system-account user: it hears the servers' disconnect advisories and
    nothing else of the system account; it can publish only to its own inbox."""
    inbox = f"{inbox_prefix(DEPARTURES_USER)}.>"
    return Permissions(publish=(inbox,), subscribe=(DISCONNECTS,))


def system_users(
    departures: Credentials, system: Credentials | None = None
) -> list[tuple[Credentials, Permissions | None]]:
    """The hub's system account: the reaper's `departures`, and the registrar's `system`
    on a hub that admits machines."""
    users: list[tuple[Credentials, Permissions | None]] = [
        (departures, departures_permissions())
    ]
    return users + ([(system, None)] if system is not None else [])


def machine_permissions(user: str, workers: tuple[str, ...]) -> Permissions:
    """A machine that joined with a token (`shared.machines`): a hub trainer's rights, but
    only for its own worker ids — their heartbeats, their commands — and with replies on
    its own inbox. What NATS subjects cannot tell apart stays shared with every trainer of
    the pool: any of them may be handed any run, and the lease's key and token fence it."""
    return Permissions(
        publish=_trainer_publish(API, "", "", workers),
        subscribe=(
            f"{inbox_prefix(user.replace('-', '_'))}.>", f"{names.PREFIX}.events.>",
            *(names.control_subject(w) for w in workers),
            *(names.alive_subject(w) for w in workers),
        ),
    )  # fmt: skip


def joiner_permissions(user: str, token_id: str) -> Permissions:
    """A new machine holding a join token: it may ask to join, and hear the answer."""
    inbox = f"{inbox_prefix(user.replace('-', '_'))}.>"
    return Permissions(publish=(names.join_subject(token_id),), subscribe=(inbox,))


def registrar_permissions() -> Permissions:
    """The registrar (`services/registrar`) answers the servers' auth callout, new machines'
    joins and operators' revocations — each a reply to the asker, once — and keeps the
    machines bucket; it reads where the store is, to tell new machines. (Closing a revoked
    machine's connections it does as the system account's user, `SYSTEM_USER`.)"""
    return Permissions(
        publish=(
            *_DECLARE, f"{API}.STREAM.UPDATE.*", *_FLOW,
            *_read_kv(API, names.MACHINES_BUCKET), *_write_kv("", names.MACHINES_BUCKET),
            *_get_by_key(API, names.HUB_BUCKET),
        ),
        subscribe=(
            f"{inbox_prefix('registrar')}.>", CALLOUT_SUBJECT, f"{names.PREFIX}.join.*",
            names.SITE_JOIN_ALL, names.REVOKE_SUBJECT, names.REGISTRAR_HELLO,
        ),
        responses=True,
    )  # fmt: skip


def site_machine_permissions(user: str, workers: tuple[str, ...], site: str) -> Permissions:
    """A machine that joined at `site`: a site trainer's rights (`site_permissions`), but
    only for its own worker ids — their heartbeats, their commands — and with replies on
    its own inbox."""
    trainer = site_permissions("trainer", site)
    assert trainer is not None
    others = names.site_root(site, "workers")
    heartbeats = tuple(names.heartbeat_subject(w, site) for w in workers)
    return Permissions(
        publish=tuple(p for p in trainer.publish if p != others) + heartbeats,
        subscribe=(
            f"{inbox_prefix(user.replace('-', '_'))}.>", names.site_root(site, "events"),
            *(names.control_subject(w) for w in workers),
        ),
    )  # fmt: skip


_HUB_MACHINE_RECORDS = (
    f"{HUB_API}.DIRECT.GET.KV_{names.MACHINES_BUCKET}.$KV.{names.MACHINES_BUCKET}.>",
)
"""A machine or token record read at the hub by its key, from a site: one the site's copy
does not hold yet (`shared.machines.copy`)."""


def site_registrar_permissions(site: str) -> Permissions:
    """A site's registrar: it answers its leaf node's auth callout from the site's copy of
    the hub's machine records (`names.HUB_MACHINES_STREAM`, which it declares and reads),
    and passes joins made at the site on to the hub's registrar."""
    stream = names.HUB_MACHINES_STREAM
    return Permissions(
        publish=(
            f"{API}.INFO", f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.CREATE.{stream}",
            f"{API}.STREAM.UPDATE.{stream}", f"{API}.DIRECT.GET.{stream}.>",
            *_create_consumer(API, stream), f"{API}.CONSUMER.INFO.{stream}.>",
            f"{API}.CONSUMER.DELETE.{stream}.>", *_FLOW,
            f"{names.PREFIX}.site.{site}.join.*", *_HUB_MACHINE_RECORDS,
        ),
        subscribe=(
            f"{inbox_prefix(f'{site}_registrar')}.>", CALLOUT_SUBJECT,
            f"{names.PREFIX}.join.*", names.REGISTRAR_HELLO,
        ),
        responses=True,
    )  # fmt: skip


def site_permissions(role: str, site: str) -> Permissions | None:
    """A user of `site`'s leaf node; None for the site's operator."""
    inbox = f"{inbox_prefix(f'{site}_{role}')}.>"
    hub_kv = f"{HUB_API}."
    if role == "operator":
        return None
    if role == "submitter":
        return submitter_permissions(f"{site}-{role}", site)
    if role == "checkpointer":
        # Declares the site's streams and the buckets of the runs granted to it.
        local = [
            names.OUTBOX_STREAM, names.CKPT_STREAM, names.TASKS_STREAM, names.SUBMIT_STREAM,
            f"KV_{names.site_runs_bucket(site)}", f"KV_{names.site_leases_bucket(site)}",
            f"KV_{names.site_groups_bucket(site)}", names.HUB_RUNS_STREAM,
        ]  # fmt: skip
        return Permissions(
            publish=(
                f"{API}.INFO", *(f"{API}.STREAM.INFO.{s}" for s in local),
                *(f"{API}.STREAM.CREATE.{s}" for s in local),
                *(f"{API}.STREAM.UPDATE.{s}" for s in local),
                *_consume(API, names.CKPT_STREAM), *_FLOW,
                names.site_root(site, "events"), names.site_root(site, "dlq"),
                names.hello_subject(site),
            ),
            subscribe=(inbox,),
        )  # fmt: skip
    if role == "dispatcher":
        # Jobs submitted at the site: dispatched there, as grants to the site itself
        # (`services/dispatcher/site.py`); it asks the hub whether a run id is known there,
        # or, cut off, the site's copy of the hub's records.
        runs = names.site_runs_bucket(site)
        return Permissions(
            publish=(
                f"{API}.INFO", *_FLOW, *_consume(API, names.SUBMIT_STREAM),
                f"{API}.CONSUMER.INFO.{names.TASKS_STREAM}.>",
                *_read_kv(API, runs), *_write_kv("", runs),
                names.site_root(site, "tasks"), names.site_root(site, "events"),
                names.site_root(site, "dlq"),
                f"{HUB_API}.INFO", f"{HUB_API}.STREAM.INFO.KV_{names.RUNS_BUCKET}",
                f"{HUB_API}.DIRECT.GET.KV_{names.RUNS_BUCKET}.>",
                f"{HUB_API}.DIRECT.GET.{names.ARCHIVE_STREAM}.>",
                f"{API}.DIRECT.GET.{names.HUB_RUNS_STREAM}.>",
            ),
            subscribe=(inbox,),
        )  # fmt: skip
    if role == "trainer":
        # The runs granted to the site: its own work queue and buckets, in its own domain
        # (`services/trainer/granted.py`); a granted group's calls for ranks into that queue.
        granted = (
            names.site_runs_bucket(site), names.site_leases_bucket(site),
            names.site_groups_bucket(site),
        )  # fmt: skip
        return Permissions(
            publish=(
                *_trainer_publish(HUB_API, hub_kv, site),
                *_consume(API, names.TASKS_STREAM),
                *_read_kv(API, *granted),
                *_write_kv("", *granted),
                names.site_root(site, "ranks"),
            ),
            subscribe=(inbox, f"{names.PREFIX}.control.>", names.site_root(site, "events")),
        )
    raise ValueError(f"no such role at a site: {role!r}")


def site_link(site: str) -> Permissions:
    """The leaf node's own user at the hub: what may cross the link. Out of the site: its
    own subjects, its users' calls into the hub's JetStream and their acks, and what the
    hub's sourcing needs back (API replies on `$JSC.R.`, deliveries on `$JS.S.`). Into the
    site: commands to its trainers, replies to its users, and the hub's calls into the
    site's JetStream to source its outbox."""
    site_users = [f"{inbox_prefix(f'{site}_{r}')}.>" for r in SITE_ROLES]
    hub_calls = sorted(
        {
            s
            for r in ("trainer", "submitter", "dispatcher")
            for s in (site_permissions(r, site) or Permissions((), ())).publish
            if s.startswith(f"{HUB_API}.") or s.startswith("$JS.ACK.")
        }
    )
    # The site's JetStream answers the dispatcher's grants (`services/dispatcher/delegation.py`),
    # and sources the hub's run records (`shared.bus.streams`: consumers it creates at the
    # hub, their answers on `$JSC.R.`, their deliveries under the site's own prefix).
    # And, at a site that admits machines, the hub's machine records (`services/registrar`).
    copied = (f"KV_{names.RUNS_BUCKET}", names.ARCHIVE_STREAM, f"KV_{names.MACHINES_BUCKET}")
    out = (
        f"{names.PREFIX}.site.{site}.>", *hub_calls, *_FLOW, "$JSC.R.>", "$JS.S.>",
        f"{inbox_prefix('dispatcher')}.>", *_HUB_MACHINE_RECORDS,
        *(f"{HUB_API}.CONSUMER.CREATE.{s}{tail}" for s in copied for tail in ("", ".>")),
    )  # fmt: skip
    # Machines that joined at the site: their replies from the hub's JetStream.
    machines = f"{inbox_prefix(MACHINE_INBOX)}*.>"
    into = (
        *site_users, f"{inbox_prefix(f'{site}_registrar')}.>", machines,
        f"{names.PREFIX}.control.>", f"$JS.{site}.API.>", *_FLOW,
        names.site_root(site, "tasks"), f"{names.from_hub(site)}.>", "$JSC.R.>",
    )  # fmt: skip
    return Permissions(publish=out, subscribe=into)


# -- server configuration -----------------------------------------------------------


def authorization(
    users: list[tuple[Credentials, Permissions | None]],
    system: list[tuple[Credentials, Permissions | None]] | None = None,
    callout_issuer: str = "", bypass: list[str] | None = None,
) -> str:  # fmt: skip
    """An `authorization { users = [...] }` block. JSON is valid NATS configuration, and
    quoting every subject keeps `$` and `>` from being read as variables or syntax.
    `system`: the system account's users (the servers' own events), in an account of their
    own. With `callout_issuer`, every user but those in `bypass` (default: all of `users`)
    and the system account's is asked of the registrar (NATS's auth callout,
    docs/machines.md)."""
    body: dict[str, Any] = {"users": [_user(c, p) for c, p in users]}
    system = system or []
    if callout_issuer:
        assert system, "the callout needs the system account's user"
        body["auth_callout"] = {
            "issuer": callout_issuer,
            "auth_users": [
                *(bypass if bypass is not None else [c.user for c, _ in users]),
                *(c.user for c, _ in system),
            ],
        }
    block = "authorization " + json.dumps(body, indent=2)
    if not system:
        return block
    accounts = {"SYS": {"users": [_user(c, p) for c, p in system]}}
    return block + f"\naccounts {json.dumps(accounts, indent=2)}\nsystem_account: SYS"


def _user(creds: Credentials, perms: Permissions | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"user": creds.user, "password": creds.password}
    if perms is not None:
        entry["permissions"] = {
            "publish": {"allow": list(perms.publish)},
            "subscribe": {"allow": list(perms.subscribe)},
        }
        if perms.responses:
            entry["permissions"]["allow_responses"] = True
    return entry


def env_name(user: str) -> str:
    """The environment variable a deployment's config reads `user`'s password from."""
    return "BATON_PW_" + user.upper().replace("-", "_")


def deployment_config(
    site: str | None, sites: tuple[str, ...] = (), submitters: tuple[str, ...] = ()
) -> str:
    """The `authorization` block of the hub (`site` None, admitting `sites` and a submitter
    user for each of `submitters`, its people) or of a site's leaf node, with every password
    a NATS variable (`env_name`): the committed files in deploy/nats hold no secret. The
    hub's has its system account too (`system_users`)."""
    if site:
        users = [(f"{site}-{r}", site_permissions(r, site)) for r in SITE_ROLES]
    else:
        users = [(r, hub_permissions(r)) for r in HUB_ROLES]
        users += [(u, submitter_permissions(u)) for u in submitters]
        users += [(f"site-{s}", site_link(s)) for s in sites]
    departures = Credentials(DEPARTURES_USER, f"${env_name(DEPARTURES_USER)}")
    system = None if site else system_users(departures)
    block = authorization([(Credentials(u, f"${env_name(u)}"), p) for u, p in users], system)
    for user in [u for u, _ in users] + [c.user for c, _ in system or []]:
        # A NATS variable is a bare `$NAME`, never inside quotes.
        block = block.replace(f'"${env_name(user)}"', f"${env_name(user)}")
    return block
