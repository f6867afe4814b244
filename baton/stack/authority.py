"""A stack's authority: its credentials (`Vault`), the authorization its servers enforce
(every role's permissions, the sites' links, the people, the machines' callout) and the
people reloaded on SIGHUP (`reload_people`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

from baton.stack.cluster import HubCluster
from baton.stack.natsconf import hub_fragment
from baton.stack.natsserver import NatsServerError
from baton.stack.options import StackOptions, admits_machines, has_people, user_of, vault
from baton.stack.people import People
from shared.auth import (
    DEPARTURES_USER,
    HUB_ROLES,
    SITE_ROLES,
    SYSTEM_USER,
    authorization,
    hub_permissions,
    registrar_permissions,
    site_link,
    site_permissions,
    site_registrar_permissions,
    submitter_permissions,
    system_users,
)
from shared.credentials import Vault, options_for
from shared.machines.callout import issuer_public, new_issuer_seed


def callout_seed(v: Vault) -> Path:
    """The account key the registrar signs the callout's answers with; the servers know
    its public half (`shared.machines.callout`)."""
    return v.secret("callout", lambda: new_issuer_seed().decode())


def authorization_for(opts: StackOptions, v: Vault) -> str:
    if opts.site:
        site = [(v.get(user_of(opts, r)), site_permissions(r, opts.site)) for r in SITE_ROLES]
        if not admits_machines(opts):
            return authorization(site)
        # Machines that joined at the site log in here, through its own registrar.
        site.append((v.get(user_of(opts, "registrar")), site_registrar_permissions(opts.site)))
        issuer = issuer_public(callout_seed(v).read_bytes().strip())
        return authorization(site, [(v.get(SYSTEM_USER), None)], issuer)
    users = [(v.get(r), hub_permissions(r)) for r in HUB_ROLES]
    users += [(v.get(u), submitter_permissions(u)) for u in opts.submitters]
    users += [(v.get(f"site-{s}"), site_link(s)) for s in opts.sites]
    if not admits_machines(opts):
        return authorization(users, system_users(v.get(DEPARTURES_USER)))
    users.append((v.get("registrar"), registrar_permissions()))
    issuer = issuer_public(callout_seed(v).read_bytes().strip())
    # The people are asked of the registrar too: the servers' `auth_users` cannot change
    # while they run, and the people do.
    bypass = [c.user for c, _ in users if c.user not in opts.submitters]
    system = system_users(v.get(DEPARTURES_USER), v.get(SYSTEM_USER))
    return authorization(users, system, issuer, bypass)


def hub_config(opts: StackOptions, v: Vault | None) -> str:
    """What every hub node's config adds to the server's own settings."""
    return hub_fragment() + "\n" + (authorization_for(opts, v) if v else "")


async def reload_people(opts: StackOptions, server: HubCluster) -> StackOptions:
    """Build the hub's authorization again from the people there are now, and have every
    node reload it (a node down now starts with it); returns the options it was built
    from. The servers close a removed person's connections themselves. Names and
    credentials are read under the people's lock: none is half added or half removed.

    On a hub that admits machines nothing is reloaded: the registrar admits the people
    from their file at every login, and a reload would have the servers ask it again
    about every connection at once — a machine's or person's whose answer comes late is
    closed (measured beside CPU hogs). A removed person's connections are closed through
    the system account instead."""
    people = People(opts.data_dir)
    before = set(opts.submitters)
    with people.locked():
        opts = msgspec.structs.replace(opts, submitters=tuple(people.names()))
        config = hub_config(opts, vault(opts))
    if not admits_machines(opts):
        await server.reload(config)
    elif gone := sorted(before - set(opts.submitters)):
        await _close_people(opts, server.url, gone)
    return opts


async def _close_people(opts: StackOptions, url: str, gone: list[str]) -> None:
    """Close removed people's connections on a hub that admits machines, where the registrar
    admitted them (`shared.machines.connections`)."""
    from shared.bus.connect import connect
    from shared.machines.connections import close_all

    v = vault(opts)
    assert v is not None
    nc = await connect(url, "baton-up-system", first_attempt_timeout=10,
                       options=options_for(v.get(SYSTEM_USER)))  # fmt: skip
    try:
        for person in gone:
            await close_all(nc, person)
    finally:
        await nc.close()


def with_people(opts: StackOptions) -> StackOptions:
    """At start: `opts.submitters` added to the people, and the stack run with them all."""
    if not has_people(opts):
        return opts
    return msgspec.structs.replace(opts, submitters=People(opts.data_dir).adding(opts.submitters))


def catch_up(opts: StackOptions, reload: asyncio.Event) -> None:
    """Once `stack.json` tells `baton people` whom to signal: a reload if the people changed
    while the stack started, when no one knew it."""
    if has_people(opts) and People(opts.data_dir).changed_from(opts.submitters):
        reload.set()


async def on_sighup(opts: StackOptions, server: HubCluster) -> StackOptions:
    """`reload_people`, saying what came of it on stderr (the stack goes on either way)."""
    if not has_people(opts):
        print("SIGHUP: this stack has no people to reload", file=sys.stderr, flush=True)
        return opts
    try:
        opts = await reload_people(opts, server)
    except (ValueError, OSError, NatsServerError) as exc:
        print(f"error: the people were not reloaded: {exc}", file=sys.stderr, flush=True)
        return opts
    people = ", ".join(opts.submitters) or "none"
    how = "the registrar admits them" if admits_machines(opts) else "every hub node reloaded"
    print(f"people: {people} ({how})", file=sys.stderr, flush=True)
    return opts
