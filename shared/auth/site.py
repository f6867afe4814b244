"""A site's roles on its leaf node, and the leaf's own link to the hub (`site-<name>`)."""

from __future__ import annotations

from shared.auth.hub import submitter_permissions
from shared.auth.vocabulary import (
    API,
    FLOW,
    HUB_API,
    HUB_MACHINE_RECORDS,
    MACHINE_INBOX,
    Permissions,
    consume,
    read_kv,
    trainer_publish,
    write_kv,
)
from shared.bus import names
from shared.credentials import inbox_prefix

SITE_ROLES = ("operator", "submitter", "checkpointer", "dispatcher", "trainer")


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
                *consume(API, names.CKPT_STREAM), *FLOW,
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
                f"{API}.INFO", *FLOW, *consume(API, names.SUBMIT_STREAM),
                f"{API}.CONSUMER.INFO.{names.TASKS_STREAM}.>",
                # The site's live trainers, by their heartbeats in the outbox (a run of
                # several ranks is accepted when the site has the ranks).
                f"{API}.STREAM.INFO.{names.OUTBOX_STREAM}",
                f"{API}.STREAM.MSG.GET.{names.OUTBOX_STREAM}",
                *read_kv(API, runs), *write_kv("", runs),
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
                *trainer_publish(HUB_API, hub_kv, site),
                *consume(API, names.TASKS_STREAM),
                *read_kv(API, *granted),
                *write_kv("", *granted),
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
        f"{names.PREFIX}.site.{site}.>", *hub_calls, *FLOW, "$JSC.R.>", "$JS.S.>",
        f"{inbox_prefix('dispatcher')}.>", *HUB_MACHINE_RECORDS,
        *(f"{HUB_API}.CONSUMER.CREATE.{s}{tail}" for s in copied for tail in ("", ".>")),
    )  # fmt: skip
    # Machines that joined at the site: their replies from the hub's JetStream.
    machines = f"{inbox_prefix(MACHINE_INBOX)}*.>"
    into = (
        *site_users, f"{inbox_prefix(f'{site}_registrar')}.>", machines,
        f"{names.PREFIX}.control.>", f"$JS.{site}.API.>", *FLOW,
        names.site_root(site, "tasks"), f"{names.from_hub(site)}.>", "$JSC.R.>",
    )  # fmt: skip
    return Permissions(publish=out, subscribe=into)
