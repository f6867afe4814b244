"""Machines and the system account: the auth callout's registrar, joined machines and those
joining, the departures user that hears connections close, and the system user."""

from __future__ import annotations

from shared.auth.site import site_permissions
from shared.auth.vocabulary import (
    API,
    DECLARE,
    FLOW,
    HUB_MACHINE_RECORDS,
    Permissions,
    create_consumer,
    get_by_key,
    read_kv,
    trainer_publish,
    write_kv,
)
from shared.bus import names
from shared.credentials import Credentials, inbox_prefix

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"


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
        publish=trainer_publish(API, "", "", workers),
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
            *DECLARE, f"{API}.STREAM.UPDATE.*", *FLOW,
            *read_kv(API, names.MACHINES_BUCKET), *write_kv("", names.MACHINES_BUCKET),
            *get_by_key(API, names.HUB_BUCKET),
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


def site_registrar_permissions(site: str) -> Permissions:
    """A site's registrar: it answers its leaf node's auth callout from the site's copy of
    the hub's machine records (`names.HUB_MACHINES_STREAM`, which it declares and reads),
    and passes joins made at the site on to the hub's registrar."""
    stream = names.HUB_MACHINES_STREAM
    return Permissions(
        publish=(
            f"{API}.INFO", f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.CREATE.{stream}",
            f"{API}.STREAM.UPDATE.{stream}", f"{API}.DIRECT.GET.{stream}.>",
            *create_consumer(API, stream), f"{API}.CONSUMER.INFO.{stream}.>",
            f"{API}.CONSUMER.DELETE.{stream}.>", *FLOW,
            f"{names.PREFIX}.site.{site}.join.*", *HUB_MACHINE_RECORDS,
        ),
        subscribe=(
            f"{inbox_prefix(f'{site}_registrar')}.>", CALLOUT_SUBJECT,
            f"{names.PREFIX}.join.*", names.REGISTRAR_HELLO,
        ),
        responses=True,
    )  # fmt: skip
