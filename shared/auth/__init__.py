"""Who may do what on NATS: one user per role, each with allow-lists of exactly what it needs.

A package by the families of roles, over one shared vocabulary (`vocabulary`: `Permissions`
and the phrases allow-lists are written in): the hub's roles (`hub`), a site's and its
link (`site`), machines and the system account (`machines`), and the servers'
`authorization` block made of them (`config`). Every public name is here too.

Whoever can publish a job can run code on a GPU, so the roles are enforced by the servers,
not by Baton's code. Every list in this package is an *allow* list: what is not named is
denied. At the hub:

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

from shared.auth.config import (
    authorization as authorization,
)
from shared.auth.config import (
    deployment_config as deployment_config,
)
from shared.auth.config import (
    env_name as env_name,
)
from shared.auth.hub import (
    DASHBOARD_REPLAYS as DASHBOARD_REPLAYS,
)
from shared.auth.hub import (
    HUB_ROLES as HUB_ROLES,
)
from shared.auth.hub import (
    dashboard_permissions as dashboard_permissions,
)
from shared.auth.hub import (
    hub_permissions as hub_permissions,
)
from shared.auth.hub import (
    notifier_permissions as notifier_permissions,
)
from shared.auth.hub import (
    submitter_permissions as submitter_permissions,
)
from shared.auth.machines import (
    CALLOUT_SUBJECT as CALLOUT_SUBJECT,
)
from shared.auth.machines import (
    DEPARTURES_USER as DEPARTURES_USER,
)
from shared.auth.machines import (
    DISCONNECTS as DISCONNECTS,
)
from shared.auth.machines import (
    SYSTEM_USER as SYSTEM_USER,
)
from shared.auth.machines import (
    departures_permissions as departures_permissions,
)
from shared.auth.machines import (
    joiner_permissions as joiner_permissions,
)
from shared.auth.machines import (
    machine_permissions as machine_permissions,
)
from shared.auth.machines import (
    registrar_permissions as registrar_permissions,
)
from shared.auth.machines import (
    site_machine_permissions as site_machine_permissions,
)
from shared.auth.machines import (
    site_registrar_permissions as site_registrar_permissions,
)
from shared.auth.machines import (
    system_users as system_users,
)
from shared.auth.site import (
    SITE_ROLES as SITE_ROLES,
)
from shared.auth.site import (
    site_link as site_link,
)
from shared.auth.site import (
    site_permissions as site_permissions,
)
from shared.auth.vocabulary import (
    ALL_KV as ALL_KV,
)
from shared.auth.vocabulary import (
    API as API,
)
from shared.auth.vocabulary import (
    DECLARE as DECLARE,
)
from shared.auth.vocabulary import (
    FLOW as FLOW,
)
from shared.auth.vocabulary import (
    GET_ARCHIVED as GET_ARCHIVED,
)
from shared.auth.vocabulary import (
    HUB_API as HUB_API,
)
from shared.auth.vocabulary import (
    HUB_MACHINE_RECORDS as HUB_MACHINE_RECORDS,
)
from shared.auth.vocabulary import (
    MACHINE_INBOX as MACHINE_INBOX,
)
from shared.auth.vocabulary import (
    SENT as SENT,
)
from shared.auth.vocabulary import (
    Permissions as Permissions,
)
from shared.auth.vocabulary import (
    consume as consume,
)
from shared.auth.vocabulary import (
    create_consumer as create_consumer,
)
from shared.auth.vocabulary import (
    get_by_key as get_by_key,
)
from shared.auth.vocabulary import (
    owner_of as owner_of,
)
from shared.auth.vocabulary import (
    read_kv as read_kv,
)
from shared.auth.vocabulary import (
    read_ledger as read_ledger,
)
from shared.auth.vocabulary import (
    trainer_publish as trainer_publish,
)
from shared.auth.vocabulary import (
    write_kv as write_kv,
)

