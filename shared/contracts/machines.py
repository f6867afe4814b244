"""Machines that join a hub with a token, each with an identity of its own (`shared.machines`).

Records in the `baton_machines` bucket (`token.<id>`, `machine.<id>`) and the join request
and answer between a new machine and the hub's registrar (`services/registrar`). A record
keeps only a digest of each secret: the secret itself exists on the machine that holds it
(and, for a token, with whoever it was handed to).
"""

from __future__ import annotations

import msgspec

from shared.contracts.checkpoints import StoreInfo


class JoinToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A one-time, expiring right to join `pool` (`baton token create`)."""

    id: str
    digest: str
    """sha256 of the token's secret, hex."""
    pool: str
    site: str = ""
    created_at: float
    expires_at: float
    created_by: str = ""
    used_by: str = ""
    """The machine that joined with it; a used token is refused from then on."""
    used_at: float = 0.0


class Machine(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A machine that joined: who it is on NATS (user `id`, its secret's digest) and the
    trainers it runs, whose worker ids are its own (`workers`)."""

    id: str
    host: str
    pool: str
    site: str = ""
    digest: str
    trainers: int
    gpus: tuple[str, ...] = ()
    """Its GPUs' names, one per trainer; empty on a machine without one."""
    token: str
    """The join token it used."""
    joined_at: float
    revoked_at: float = 0.0
    revoked_by: str = ""

    @property
    def revoked(self) -> bool:
        return self.revoked_at > 0

    def workers(self) -> tuple[str, ...]:
        """Its trainers' worker ids: the only ones its credentials may speak for."""
        return tuple(f"{self.id}-trainer-{i}" for i in range(1, self.trainers + 1))


class JoinRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a new machine says of itself when it joins (`baton join`)."""

    host: str
    trainers: int
    gpus: tuple[str, ...] = ()


class JoinAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The registrar's answer: the machine's identity and where the store is, or why not."""

    error: str = ""
    machine: str = ""
    secret: str = ""
    """The machine's NATS password: sent once, here, and never stored at the hub."""
    pool: str = ""
    site: str = ""
    store: StoreInfo | None = None
    env: dict[str, str] = {}
    """What the machine's trainers must share with the hub's: the store's settings and
    credentials as the hub's services have them (`AWS_ACCESS_KEY_ID`, …), so that they read
    and write checkpoints as the hub's do, and the lease TTL."""


class Revoke(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An operator's request to revoke a machine (`baton machines revoke`)."""

    machine: str
    by: str = ""


class Revoked(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The registrar's answer: connections it closed, or why it did not."""

    error: str = ""
    machine: str = ""
    closed: int = 0
    """The machine's connections the hub's servers closed."""
    site: str = ""
    """The site the machine joined: its own registrar closes its connections there once
    the record reaches it (`services/registrar/site.py`)."""
