"""Every subject, stream, consumer and bucket name Baton uses, in one place.

Subjects carry the run id as a token wherever a message belongs to one run, so that a
single run's traffic can be filtered, looked up (`get_last_msg`) or purged without
scanning a stream.
"""

from __future__ import annotations

PREFIX = "baton"

# Streams.
SUBMIT_STREAM = "BATON_SUBMIT"
TASKS_STREAM = "BATON_TASKS"
EVENTS_STREAM = "BATON_EVENTS"
CKPT_STREAM = "BATON_CKPT"
DLQ_STREAM = "BATON_DLQ"
CANCEL_STREAM = "BATON_CANCEL"
LOGS_STREAM = "BATON_LOGS"
ADVISORY_STREAM = "BATON_ADVISORIES"
# Ended runs' records once they left the runs bucket: one message per run, read by run id.
ARCHIVE_STREAM = "BATON_ARCHIVE"
# In a site's own JetStream domain: everything the site sends to the hub, kept there until
# the hub's streams have sourced it (see `shared.bus.sourcing`). The site's commit requests live in
# a site-domain stream named CKPT_STREAM too, with site subjects.
OUTBOX_STREAM = "BATON_OUTBOX"
HUB_MACHINES_STREAM = "BATON_HUB_MACHINES"
"""At a site that admits machines: the hub's machine and token records, newest per key,
sourced while the link is up, so a cut-off site still knows its machines
(`services/registrar`)."""
# In a site's own domain: the hub's run records (live and archived), newest per run, sourced
# while the link is up, so a cut-off site still knows every run id the hub used
# (`services/dispatcher/site.py`).
HUB_RUNS_STREAM = "BATON_HUB_RUNS"

# At the hub: the records of runs granted to sites, as each site's own runs bucket holds
# them, sourced from the sites and taken in once by the reaper (`services/reaper/grants.py`).
REPORTS_STREAM = "BATON_REPORTS"

# The credits ledger: one message per entry, each under its own subject, written once
# (`shared.ledger`).
LEDGER_STREAM = "BATON_LEDGER"

# JetStream domain of the hub, as sites address it.
HUB_DOMAIN = "hub"

# KV buckets.
RUNS_BUCKET = "baton_runs"
LEASES_BUCKET = "baton_leases"
WORKERS_BUCKET = "baton_workers"
POOLS_BUCKET = "baton_pools"
SITES_BUCKET = "baton_sites"
# One key per run not yet retired (over for BATON_GC_AGE): how the reaper and `baton runs`
# find live runs without reading the history (`shared.state.runs`).
LIVE_BUCKET = "baton_live"
# Groups of ranks: one key per forming or training group, one per rank's trainer, each with a
# short TTL its writer renews (`services/trainer/group.py`).
GROUPS_BUCKET = "baton_groups"
# Trainers taken out of their pool by an operator (`baton drain`): one key per worker id,
# written by operators, read by the trainer it names (`shared.state.drains`).
DRAINS_BUCKET = "baton_drains"
# What the notifier has sent, one key per notification and receiver, and each site's
# cut-off episodes (`services/notifier`).
ALERTS_BUCKET = "baton_alerts"
# The pools' configuration in force, one key (`shared.state.policy`): priorities, owners'
# weights and quotas, prices — read by every service, written by operators.
POLICY_BUCKET = "baton_policy"
# What the hub tells any client about itself, one key per fact: `store`, where its
# checkpoint store is (`shared.state.hub`), written by the hub's checkpointer.
HUB_BUCKET = "baton_hub"
# Machines that joined with a token, and the tokens: `token.<id>` and `machine.<id>`, written
# by operators (tokens, revocations) and the registrar (joins), read by the registrar on every
# connection a machine makes (`shared.machines`).
MACHINES_BUCKET = "baton_machines"

# Durable consumers.
DISPATCHER_CONSUMER = "dispatcher"
CHECKPOINTER_CONSUMER = "checkpointer"
CANCEL_CONSUMER = "dispatcher-cancel"
REAPER_CONSUMER = "reaper"
NOTIFIER_CONSUMER = "notifier"
RECONCILER_CONSUMER = "reconciler"

# Subject roots, used as stream subjects and consumer filters.
SUBMIT_ALL = f"{PREFIX}.submit.>"
TASKS_ALL = f"{PREFIX}.tasks.>"
CALLS_ALL = f"{PREFIX}.calls.>"
EVENTS_ALL = f"{PREFIX}.events.>"
CKPT_ALL = f"{PREFIX}.ckpt.>"
DLQ_ALL = f"{PREFIX}.dlq.>"
CANCEL_ALL = f"{PREFIX}.cancel.>"
# Operators' requests that steer a run (roll back, pause, resume, checkpoint): kept in the
# cancel stream beside cancels, taken by the same consumer (`services/dispatcher/steering.py`).
STEER_ALL = f"{PREFIX}.steer.>"
LOGS_ALL = f"{PREFIX}.logs.>"
ARCHIVE_ALL = f"{PREFIX}.archive.>"
LEDGER_ALL = f"{PREFIX}.ledger.>"
# Core NATS requests to the scheduler (in the dispatcher): a pool's queue, in order, each
# run with why it waits (`baton queue`, the dashboard).
QUEUE_ALL = f"{PREFIX}.queue.*"
REPORTS_ALL = f"{PREFIX}.reports.>"
# JetStream's own advisory when a message has used up its deliveries, for our work queues
# (wildcards match whole tokens only, so each stream is named).
MAX_DELIVERIES_ADVISORIES = [
    f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*"
    for stream in (SUBMIT_STREAM, TASKS_STREAM, CKPT_STREAM, CANCEL_STREAM)
]


def submit_subject(pool: str, owner: str = "") -> str:
    """Where jobs for `pool` are submitted; a submitter's subject ends in its own name,
    which the servers enforce, so the dispatcher can trust it as the runs' owner."""
    return f"{PREFIX}.submit.{pool}.{owner}" if owner else f"{PREFIX}.submit.{pool}"


def task_subject(pool: str, run_id: str) -> str:
    return f"{PREFIX}.tasks.{pool}.{run_id}"


def tasks_of_pool(pool: str) -> str:
    return f"{PREFIX}.tasks.{pool}.>"  # run ids may have two tokens (`owner.r…`)


def call_subject(pool: str, run_id: str) -> str:
    """A group's leader calls for its other ranks here, on the same work queue as tasks."""
    return f"{PREFIX}.calls.{pool}.{run_id}"


def calls_of_pool(pool: str) -> str:
    return f"{PREFIX}.calls.{pool}.>"


def call_id(run_id: str, epoch: int, rank: int, grow: bool = False) -> str:
    """A call is published once per rank and epoch, however often its publish is retried
    (an elastic group's growth call once more, for a slot it formed without)."""
    return f"{'grow' if grow else 'call'}.{run_id}.{epoch}.{rank}"


def group_key(pool: str, run_id: str) -> str:
    """A run's group in the groups bucket; `groups_of_pool` finds the pool's groups."""
    return f"g.{pool}.{run_id}"


def groups_of_pool(pool: str) -> str:
    return f"g.{pool}.>"


def member_key(run_id: str, epoch: int, rank: int) -> str:
    return f"m.{epoch}.{rank}.{run_id}"


def trainer_consumer(pool: str) -> str:
    return f"trainer-{pool}"


def event_subject(run_id: str, kind: str) -> str:
    return f"{PREFIX}.events.{run_id}.{kind}"


def ending_id(kind: str, run_id: str) -> str:
    """The one message id of a run's terminal event (`completed.<run>`): whoever publishes
    it, the events stream stores it once within its deduplication window."""
    return f"{kind}.{run_id}"


def handover_id(run_id: str, token: int) -> str:
    """The message id of a run's hand-over from the attempt holding `token`: an attempt is
    handed over once, whoever notices its death first."""
    return f"handed_over.{run_id}.{token}"


def events_of_run(run_id: str) -> str:
    return f"{PREFIX}.events.{run_id}.*"


def commit_subject(run_id: str) -> str:
    return f"{PREFIX}.ckpt.commit.{run_id}"


def cancel_subject(run_id: str) -> str:
    return f"{PREFIX}.cancel.{run_id}"


def steer_subject(run_id: str) -> str:
    """Where a request that steers `run_id` is published (`shared.contracts.control.Steer`)."""
    return f"{PREFIX}.steer.{run_id}"


def notified_events() -> list[str]:
    """The events the notifier tells people of, as its consumer's filters: a run's id is
    one token, or two for a submitter's run (`owner.r…`), so each type is named twice."""
    kinds = ("failed", "warning", "guarded", "paused")
    return [f"{PREFIX}.events.{run}.{k}" for k in kinds for run in ("*", "*.*")]


def site_alert_subject(site: str) -> str:
    """What a dead letter of a site's alert names as its subject; no stream listens here."""
    return f"{PREFIX}.alerts.site.{site}"


def logs_subject(run_id: str) -> str:
    """The entry point's stdout and stderr, as the trainer captured them."""
    return f"{PREFIX}.logs.{run_id}"


def dlq_subject(source: str) -> str:
    return f"{PREFIX}.dlq.{source}"


def letter_id(stream: str, stream_seq: int, site: str = "") -> str:
    """The message id of a dead letter: the message it copies, where it was (a site's
    streams and the hub's number their messages alike)."""
    return f"dlq.{site or HUB_DOMAIN}.{stream}.{stream_seq}"


def archive_subject(run_id: str) -> str:
    """Where an ended run's record is kept once it left the runs bucket."""
    return f"{PREFIX}.archive.{run_id}"


def ledger_subject(owner: str, kind: str, entry: str) -> str:
    """Where ledger entry `entry` (`hold.<run>.<n>`: its kind and identity) of `owner` is
    written, once (`shared.ledger.book`)."""
    return f"{PREFIX}.ledger.{owner}.{kind}.{entry}"


def ledger_of(owner: str) -> str:
    return f"{PREFIX}.ledger.{owner}.>"


def queue_subject(pool: str) -> str:
    """Where the scheduler answers for `pool`'s queue."""
    return f"{PREFIX}.queue.{pool}"


def usage_key(pool: str) -> str:
    """The scheduler's decayed usage of `pool`, per owner, in the pools bucket (kept across
    the dispatcher's restarts)."""
    return f"usage.{pool}"


def drain_key(worker_id: str) -> str:
    """A trainer's key in the drains bucket: there while it is drained."""
    return worker_id


def join_subject(token_id: str) -> str:
    """Where a new machine asks, with its join token, for an identity of its own."""
    return f"{PREFIX}.join.{token_id}"


def site_join_subject(site: str, token_id: str) -> str:
    """Where a site's registrar asks the hub's for a machine joining at `site`: a site's
    own subject, the only kind its link lets out (`shared.auth.site_link`)."""
    return f"{PREFIX}.site.{site}.join.{token_id}"


SITE_JOIN_ALL = f"{PREFIX}.site.*.join.*"

REVOKE_SUBJECT = f"{PREFIX}.machines.revoke"
"""Where an operator asks the registrar to revoke a machine (`baton machines revoke`)."""
REGISTRAR_HELLO = f"{PREFIX}.machines.hello"
"""Answered by the registrar: whether the hub admits machines at all."""


def control_subject(worker_id: str) -> str:
    """Where a trainer listens for commands addressed to it (cancel, kill)."""
    return f"{PREFIX}.control.{worker_id}"


ALL_STREAMS = (
    "BATON_SUBMIT",
    "BATON_TASKS",
    "BATON_CKPT",
    "BATON_CANCEL",
    "BATON_EVENTS",
    "BATON_LOGS",
    "BATON_DLQ",
    "BATON_ADVISORIES",
    "BATON_ARCHIVE",
    "BATON_OUTBOX",
    "BATON_REPORTS",
    "BATON_LEDGER",
)


# -- sites ----------------------------------------------------------------------------
#
# A site publishes what the hub must receive on the same subjects with `site.<name>.` after
# the prefix (`baton.site.lab1.events.<run>.<kind>`). Those are captured by the site's own
# outbox, never by a hub stream (hub streams listen on `baton.events.>` etc.), so a message
# is stored once at the site and copied once to the hub by sourcing — whether the link was
# up or down when it was published (docs/nats.md: "Double capture").

SITE_OUTBOX_KINDS = ("events", "logs", "dlq", "cancel", "workers", "calls")
"""Subject roots a site sends to the hub through its outbox; `workers` are heartbeats,
sourced into the workers bucket; `calls` a site trainer's calls for the ranks of the group
it leads, sourced into the work queue. Jobs submitted at a site (`submit`) stay there: the
site's own dispatcher takes them (`services/dispatcher/site.py`)."""


def at_site(subject: str, site: str) -> str:
    """The subject a message bound for the hub takes when published at `site` ("" = hub)."""
    if not site:
        return subject
    head, _, rest = subject.partition(".")
    assert head == PREFIX, subject
    return f"{PREFIX}.site.{site}.{rest}"


def site_root(site: str, kind: str) -> str:
    return f"{PREFIX}.site.{site}.{kind}.>"


def from_hub(site: str) -> str:
    """The prefix of what the hub's JetStream delivers to `site`'s own streams (its copy
    of the hub's records): a site's link admits its own deliveries, no other site's."""
    return f"{PREFIX}.site.{site}.from_hub"


def site_task_subject(site: str, pool: str, run_id: str) -> str:
    """Where the hub puts a task it delegates to `site`: into the site's own work queue
    (`BATON_TASKS` in the site's domain), never into the outbox."""
    return f"{PREFIX}.site.{site}.tasks.{pool}.{run_id}"


def site_tasks_of_pool(site: str, pool: str) -> str:
    return f"{PREFIX}.site.{site}.tasks.{pool}.>"


def site_call_subject(site: str, pool: str, run_id: str) -> str:
    """Where the leader of a group granted to `site` calls for its other ranks: the site's
    own work queue, beside the granted tasks (a group granted there forms there, link or no
    link; a site trainer leading a run the hub holds calls through the outbox instead)."""
    return f"{site_calls_root(site)}{pool}.{run_id}"


def site_calls_root(site: str) -> str:
    return f"{PREFIX}.site.{site}.ranks."


def site_calls_of_pool(site: str, pool: str) -> str:
    return f"{site_calls_root(site)}{pool}.>"


def site_groups_bucket(site: str) -> str:
    """The groups of the runs granted to `site`, in its own domain."""
    return f"{GROUPS_BUCKET}_{site}"


def site_runs_bucket(site: str) -> str:
    """The runs bucket in `site`'s domain: the records of the runs granted to it. Named
    after the site, so that no bucket at the hub or at another site shares its subjects."""
    return f"{RUNS_BUCKET}_{site}"


def site_leases_bucket(site: str) -> str:
    return f"{LEASES_BUCKET}_{site}"


def report_subject(site: str, run_id: str) -> str:
    """A site's record of a run granted to it, as the hub's reports stream holds it."""
    return f"{PREFIX}.reports.{site}.{run_id}"


def hello_subject(site: str) -> str:
    """Core NATS: a site's checkpointer says it is there, about once a second."""
    return f"{PREFIX}.site.{site}.hello"


HELLO_ALL = f"{PREFIX}.site.*.hello"


PULSE_ALL = f"{PREFIX}.pulse.*"


def pulse_subject(worker_id: str) -> str:
    """Core NATS: a hub trainer's pulse while it holds a run (`shared.contracts.control.Pulse`)."""
    return f"{PREFIX}.pulse.{worker_id}"


ALIVE_ALL = f"{PREFIX}.alive.*"


def alive_subject(worker_id: str) -> str:
    """Core NATS: a hub trainer listens here for as long as its process lives, and answers
    nothing. A request that gets "no responders" means its connection is gone
    (`shared.bus.probe`)."""
    return f"{PREFIX}.alive.{worker_id}"


def heartbeat_subject(worker_id: str, site: str) -> str:
    """A trainer's heartbeat: straight into the workers bucket at the hub; through the
    outbox (sourced into that bucket) at a site."""
    if site:
        return f"{PREFIX}.site.{site}.workers.{worker_id}"
    return f"$KV.{WORKERS_BUCKET}.{worker_id}"


def pool_from_submit_subject(subject: str) -> str:
    return subject.split(".")[2]


def owner_from_submit_subject(subject: str) -> str:
    parts = subject.split(".")
    return parts[3] if len(parts) > 3 else ""
