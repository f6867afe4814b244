"""Server configuration: the `authorization` block the servers enforce, from users and
their permissions, for `baton up` and for a deployment's committed files."""

from __future__ import annotations

import json
from typing import Any

from shared.auth.hub import HUB_ROLES, hub_permissions, submitter_permissions
from shared.auth.machines import DEPARTURES_USER, system_users
from shared.auth.site import SITE_ROLES, site_link, site_permissions
from shared.auth.vocabulary import Permissions
from shared.credentials import Credentials


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
