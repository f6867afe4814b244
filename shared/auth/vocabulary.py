"""The permission vocabulary every family of roles is written in: `Permissions`, and the
allow-list phrases for what a role does on a stream, a bucket or the ledger."""

from __future__ import annotations

import msgspec

from shared.bus import names

API = "$JS.API"


HUB_API = f"$JS.{names.HUB_DOMAIN}.API"


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


def create_consumer(api: str, stream: str) -> list[str]:
    """Create consumers of `stream`. nats-py creates a named or filtered consumer on
    `CONSUMER.CREATE.<stream>.<name>[.<filter>]`, but an unnamed one — every ordered
    consumer, `keys()`, a history read — on the bare `CONSUMER.CREATE.<stream>`: a role
    granted only the first is refused, and its client sees nothing but a timeout."""
    return [f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>"]


def consume(api: str, stream: str) -> list[str]:
    """Bind, create and fetch from durable consumers of `stream`, and ack its messages."""
    return [
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",
        *create_consumer(api, stream),
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def read_kv(api: str, *buckets: str) -> list[str]:
    out = []
    for b in buckets:
        stream = f"KV_{b}"
        out += [
            f"{api}.STREAM.INFO.{stream}",
            f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>",
            # `keys()` and watches read through an ordered consumer of their own.
            *create_consumer(api, stream),
            f"{api}.CONSUMER.INFO.{stream}.>",
            f"{api}.CONSUMER.DELETE.{stream}.>",
        ]
    return out


def get_by_key(api: str, bucket: str) -> list[str]:
    """Read a bucket only by naming a key: no listing, no reading by sequence. The leases
    bucket is read so by trainers, whose lease keys are capabilities (`shared.state.lease`)."""
    stream = f"KV_{bucket}"
    return [f"{api}.STREAM.INFO.{stream}", f"{api}.DIRECT.GET.{stream}.$KV.{bucket}.>"]


def write_kv(prefix: str, *buckets: str) -> list[str]:
    return [f"{prefix}$KV.{b}.>" for b in buckets]


def read_ledger(api: str, owner: str = "*") -> list[str]:
    """Read ledger entries: one by its subject (a direct get), or an owner's in order (an
    ordered consumer filtered in the API subject on `owner`'s entries; `*`: anyone's)."""
    stream = names.LEDGER_STREAM
    if owner == "*":
        return [
            f"{api}.STREAM.INFO.{stream}", f"{api}.DIRECT.GET.{stream}.>",
            *create_consumer(api, stream), f"{api}.CONSUMER.DELETE.{stream}.>",
        ]  # fmt: skip
    return [
        f"{api}.CONSUMER.CREATE.{stream}.*.{names.ledger_of(owner)}",
        f"{api}.CONSUMER.DELETE.{stream}.*",
    ]


DECLARE = [f"{API}.INFO", f"{API}.STREAM.INFO.*", f"{API}.STREAM.CREATE.*"]
"""Declaring streams and buckets at start (`shared.bus.streams.ensure`): create, never delete."""


FLOW = ["$JS.FC.>"]
"""Flow-control replies of push consumers (ordered consumers, `keys()`)."""


ALL_KV = (
    names.RUNS_BUCKET, names.LEASES_BUCKET, names.WORKERS_BUCKET, names.POOLS_BUCKET,
    names.SITES_BUCKET, names.LIVE_BUCKET, names.GROUPS_BUCKET, names.POLICY_BUCKET,
)  # fmt: skip


GET_ARCHIVED = f"{API}.DIRECT.GET.{names.ARCHIVE_STREAM}.>"
"""Reading an ended run's record by its run id (`shared.state.archive`)."""


SENT = ("events", "logs", "ckpt", "dlq", "calls")
"""What a trainer publishes (at a site: on its site's subjects, into its outbox)."""


def trainer_publish(
    api: str, kv_prefix: str, site: str, workers: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """A trainer's: its work queue, the KV it reads and writes, and what it sends home.
    `workers`: the only worker ids whose heartbeats it may write (a joined machine's); none
    named, any."""
    mine = [f"$KV.{names.WORKERS_BUCKET}.{w}" for w in workers]
    heartbeats = mine or write_kv("", names.WORKERS_BUCKET)
    # That it is alive while it holds a run (`services/trainer/pulse.py`); whether a
    # member of its group is gone (`shared.bus.probe`).
    pulses = [names.pulse_subject(w) for w in workers] or [names.PULSE_ALL]
    pulses.append(names.ALIVE_ALL)
    return (
        f"{api}.INFO", *FLOW, *consume(api, names.TASKS_STREAM),
        *read_kv(api, names.RUNS_BUCKET, names.POOLS_BUCKET, names.GROUPS_BUCKET),
        *get_by_key(api, names.LEASES_BUCKET),
        # The pools' table in force (`shared.state.policy`).
        *get_by_key(api, names.POLICY_BUCKET),
        # Whether it is drained (`services/trainer/drain.py`); only operators write it.
        *get_by_key(api, names.DRAINS_BUCKET),
        *write_kv(
            kv_prefix, names.RUNS_BUCKET, names.LEASES_BUCKET, names.POOLS_BUCKET,
            names.GROUPS_BUCKET,
        ),
        # A trainer leading a group calls for its other ranks on the work queue
        # (`services/trainer/group.py`); a site trainer's calls go through its outbox.
        *(
            [names.site_root(site, k) for k in (*SENT, "workers")]
            if site
            else [f"{names.PREFIX}.{k}.>" for k in SENT] + heartbeats + pulses
        ),
    )  # fmt: skip


MACHINE_INBOX = "m_"
"""What every joined machine's inbox prefix starts with (`_INBOX_m_<id>`)."""


HUB_MACHINE_RECORDS = (
    f"{HUB_API}.DIRECT.GET.KV_{names.MACHINES_BUCKET}.$KV.{names.MACHINES_BUCKET}.>",
)
"""A machine or token record read at the hub by its key, from a site: one the site's copy
does not hold yet (`shared.machines.copy`)."""
