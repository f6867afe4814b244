"""Entries of the credits ledger: append-only, each written once under its own subject.

Every entry names its owner and has one identity — its subject,
`baton.ledger.<owner>.<kind>.<id>` (`shared.ledger.book`) — in a stream that stores one
message per subject and refuses a second: an entry is applied once through any retry, kill,
election or cut, whoever writes it. An owner's balance is the sum of its entries' `delta`s.

    kind     delta                        written by
    topup    + amount                     an operator (`baton credits topup`)
    hold     - amount                     the dispatcher, at submit, at a resume that
                                          its holds no longer cover, and at a reopening
    settle   + (held - charged)           the reaper, once the run ended: its holds come
                                          back less what it is charged (an overage, when
                                          it was charged more, is taken from the balance)

A run reopened after it was settled (`baton rollback` of a FAILED run) begins a new *life*:
its holds and its settlement are the life's own (`life`, 0 for the first), so a settlement
posts what its own life trained and voids the rest of its own life's holds, exactly once.
Life 0's entries carry no `life` (omitted, as entries written before lives were).
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
from msgspec import Meta

from shared.contracts.jobs import RUN_ID
from shared.contracts.pools import OWNER

Units = Annotated[int, Meta(ge=0, le=10**18)]


class _Entry(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="kind"
):
    owner: Annotated[str, Meta(pattern=OWNER)]
    at: float = msgspec.field(default_factory=time.time)
    """The writer's wall clock: shown, never compared."""

    @property
    def kind(self) -> str:
        tag = type(self).__struct_config__.tag
        assert isinstance(tag, str)
        return tag


class TopUp(_Entry, tag="topup", frozen=True):
    """Credits added to `owner`'s balance by an operator."""

    id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    """The top-up's identity, chosen by its writer: the same id again is the same top-up."""
    amount: Units
    by: Annotated[str, Meta(max_length=128)] = ""
    note: Annotated[str, Meta(max_length=512)] = ""

    @property
    def delta(self) -> int:
        return self.amount


Life = Annotated[int, Meta(ge=0, le=10_000)]


class Hold(_Entry, tag="hold", frozen=True, omit_defaults=True):
    """The `n`-th hold of run `run_id`'s estimated cost in its life `life` (0 at submit or
    at its reopening, 1 at its first resume its holds did not cover…): taken from the
    balance until that life is settled."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    n: Annotated[int, Meta(ge=0, le=10_000)]
    amount: Units
    life: Life = 0
    estimate: Annotated[str, Meta(max_length=512)] = ""
    """How the amount was reckoned, for people."""

    @property
    def delta(self) -> int:
        return -self.amount


class Settle(_Entry, tag="settle", frozen=True, omit_defaults=True):
    """Life `life` of run `run_id` is over: of `held` units (that life's holds) it is
    charged `charged` — the life's productive trainer-seconds and those of its own failures
    at its price (`shared.ledger.charges`), never time Baton's own failures, recovery,
    queueing or preemption cost — and gets the rest back (`refund`, below zero for an
    overage)."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    held: Units
    charged: Units
    life: Life = 0
    productive_s: float = 0.0
    """Trainer-seconds of kept progress."""
    failed_s: float = 0.0
    """Trainer-seconds of attempts its own code failed (charged too)."""
    free_s: float = 0.0
    """Trainer-seconds not charged: redone steps, recovery, restores, preemptions."""
    state: str = ""
    """How the run ended."""
    through: int = 0
    """The events stream's sequence of the last of the run's events it was charged from:
    any reader can charge the same events again and find the same units (0: charged what
    its trainers metered, its events being gone; or written before this was kept)."""

    @property
    def refund(self) -> int:
        return self.held - self.charged

    @property
    def delta(self) -> int:
        return self.refund


Entry = TopUp | Hold | Settle
