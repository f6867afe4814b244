"""Grants: runs the hub hands to a site ahead of need, which the site then holds by itself.

A site cut off from the hub must still start, lease, checkpoint and complete runs, so the
hub *grants* queued runs to a site before its trainers need them
(`services/dispatcher/delegation.py`), and the site keeps those runs' records and leases in
its own JetStream domain (`names.site_runs_bucket`, `names.site_leases_bucket`), where a
cut cannot reach them. The hub's record says which site holds the run (`RunRecord.site`);
the site's records come back to the hub by sourcing, and the reaper takes them in
(`services/reaper/grants.py`).

**Why two authorities never collide.** Every grant and every taking back moves the run's
`epoch` on, by a compare-and-swap on the hub's record, so exactly one side holds the run
at each epoch. Every fencing token — the hub's or a site's — is `epoch << 32 | revision`
(`token_of`), where the revision is that side's lease write. Within one epoch one side
issues tokens, from one bucket whose revisions only grow; across epochs the high bits
order them. The store orders checkpoints by token (`shared.checkpoint.commit`), so:

* a site's tokens are above every token the hub issued before the grant (a higher epoch);
* when the hub takes a run back (a site silent past its `lost_after`), it first moves the
  store's pointer to the next epoch's lowest token (`fence`), so the site's later commits
  are refused at once, before any other trainer starts, and a site that finishes the run
  meanwhile is refused its final commit — the run completes once;
* a revision is below 2**32 for as long as a bucket lives (four billion lease writes), so
  the low bits never carry into the epoch.

A run granted to a site is ended by the site; the hub records what the site reports, once
(`shared.state.transitions.reconcile`), and only under the epoch it granted.
"""

from __future__ import annotations

import hashlib

from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.contracts import Pointer, encode
from shared.errors import PreconditionFailed

EPOCH_SHIFT = 32
SITE_EPOCHS = 1 << 10
"""Above this, an epoch was first taken by a site for a run submitted there (`site_epoch`);
the hub's own epochs of a run count up from 0, or from the site's epoch once the hub took
the run in, one per grant or taking back."""
SITE_EPOCH_SPACING = 1 << 10
"""Epochs between two sites' first epochs: how many grants and takings back a run first
submitted at a site may see before its epochs could meet another site's."""


def token_of(epoch: int, revision: int) -> int:
    """The fencing token of a lease written at `revision` under grant `epoch`."""
    assert 0 <= revision < 1 << EPOCH_SHIFT, revision
    return (epoch << EPOCH_SHIFT) | revision


def epoch_of(token: int) -> int:
    return token >> EPOCH_SHIFT


def site_epoch(site: str) -> int:
    """The first epoch of a run submitted at `site` (`services/dispatcher/site.py`): above
    any the hub reaches by counting grants, and a site's own, so that when the same job was
    accepted at the hub and at one or more cut-off sites no two sides issue tokens of one
    epoch. Sites are told apart by a hash of their names (two names meet with a chance of
    2**-20), spaced `SITE_EPOCH_SPACING` apart; the epoch stays below 2**31, so every token
    fits a signed 64-bit integer."""
    code = int.from_bytes(hashlib.blake2s(site.encode(), digest_size=4).digest(), "big")
    return SITE_EPOCHS + (code % (1 << 20)) * SITE_EPOCH_SPACING


async def fence(store: Store, run_id: str, epoch: int) -> bool:
    """Move the run's `latest` to the lowest token of `epoch`, naming the same checkpoint,
    so that every token of an earlier epoch is refused from now on; True once it names
    that token or a higher one. With no checkpoint yet, `latest` is made a fence alone
    (`Pointer.checkpoint` None) at that token, in the same compare-and-swap a first commit
    makes: either the old grant's first commit came first, and is fenced as any, or it
    comes after, and is refused (without it, a site that finished the run before the new
    epoch's first commit had its completion counted too). False when `latest` is the run's
    final checkpoint (it was trained to the end, and only its record has yet to come back)
    or seals its end (`commit.seal`)."""
    floor = token_of(epoch, 0)
    while True:
        current = await commit.read_latest(store, run_id)
        if current is None:
            fence = Pointer(run_id=run_id, token=floor, step=0, manifest="")
            try:
                await store.write_pointer(commit.latest_key(run_id), encode(fence), None)
                return True
            except PreconditionFailed:
                continue  # a first commit landed meanwhile: fence it as any
        if current[0].token >= floor:
            return True
        pointer, version = current
        if pointer.final or pointer.ended:
            return False
        moved = Pointer(
            run_id=run_id, token=floor, step=pointer.step, manifest=pointer.manifest,
            final=pointer.final,
        )  # fmt: skip
        try:
            await store.write_pointer(commit.latest_key(run_id), encode(moved), version)
            return True
        except PreconditionFailed:
            continue
