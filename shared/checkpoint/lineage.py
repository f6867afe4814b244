"""Every checkpoint a run has stored, and where each one stands.

Invariant: only a checkpoint on the chain — reachable from `latest` through `previous` — is
ever restored (`commit.restorable` walks nothing else) or rolled back to; a rollback's
abandoned checkpoints and a fenced attempt's manifests are off it for good, unless a later
rollback's pointer names one again (it never does: a rollback's target is on the chain).

    status      what it is
    chain       reachable from `latest`: what resumes, and what a rollback may go back to
    abandoned   committed, then taken off the chain by a rollback (its note names it): kept
                until garbage collection, may be pulled or forked from, never restored
    off         off the chain otherwise: a pinned or final checkpoint older than where
                retention cut the chain, or a fenced attempt's manifest that never became
                `latest`

A fork may start from a checkpoint on the chain or an abandoned one (`find`, `anywhere`): it
copies the files into its own prefix, so nothing of the parent's is ever restored in place.
"""

from __future__ import annotations

import logging

import msgspec

from shared.checkpoint import retention
from shared.checkpoint.commit import check, key_of, load_manifest, read_latest
from shared.checkpoint.store import Store
from shared.contracts import Manifest
from shared.errors import ContractError, IntegrityError, NotFound

log = logging.getLogger("baton.lineage")

CHAIN, ABANDONED, OFF = "chain", "abandoned", "off"


class Stored(msgspec.Struct, frozen=True, kw_only=True):
    """One stored checkpoint: its manifest, where that is, and its status (above)."""

    key: str
    manifest: Manifest
    status: str
    latest: bool = False
    """The one `latest` names."""


async def stored(store: Store, run_id: str) -> list[Stored]:
    """Every checkpoint of the run whose manifest is stored, in the order `latest` moved
    through them: highest (token, step) first. A manifest that does not decode is left out
    (logged): it is nothing anyone could restore or fork from."""
    current = await read_latest(store, run_id)
    chain = {key_of(m) for m in await retention.committed_chain(store, run_id)}
    dropped = await retention.abandoned(store, run_id)
    found = []
    for key in await store.list(f"runs/{run_id}/manifests/"):
        try:
            manifest = await load_manifest(store, key)
        except NotFound:
            continue  # garbage collection took it since the listing
        except ContractError as exc:
            log.warning("%s: %s; not listed", key, exc)
            continue
        status = CHAIN if key in chain else ABANDONED if key in dropped else OFF
        head = current is not None and current[0].manifest == key
        found.append(Stored(key=key, manifest=manifest, status=status, latest=head))
    return sorted(found, key=lambda s: (s.manifest.token, s.manifest.step), reverse=True)


async def find(
    store: Store,
    run_id: str,
    step: int,
    *,
    anywhere: bool = False,
    token: int | None = None,
    resumable: bool = False,
    read: bool = True,
) -> Stored:
    """The run's committed checkpoint at `step`, checked (names, shards and every file's
    size and sha256: `commit.check`): the one on the chain, or — `anywhere` — else the
    newest abandoned one; the one written under `token`, if given (a step may have been
    committed again after a rollback); not a final one if `resumable` (the run to go on
    from it would have nothing left to train). `read`: its files are read back and hashed
    too (else only its manifest is checked). `IntegrityError` saying why there is none."""
    listed = await stored(store, run_id)
    usable = [s for s in listed if s.status == CHAIN or (anywhere and s.status == ABANDONED)]
    at = [s for s in usable if s.manifest.step == step]
    if token is not None:
        at = [s for s in at if s.manifest.token == token]
    if not at:
        why = _missing(run_id, step, listed, anywhere)
        raise IntegrityError(why if token is None else f"{why} (under token {token}: none)")
    chosen = at[0]
    if resumable and chosen.manifest.final:
        raise IntegrityError(
            f"run {run_id}'s checkpoint at step {step} is its final one: nothing is left to "
            "train from it (fork it with more total_steps instead)"
        )
    try:
        await check(store, run_id, chosen.manifest, chosen.key, read=read)
    except IntegrityError as exc:
        raise IntegrityError(
            f"run {run_id}'s checkpoint at step {step} is damaged: {exc}"
        ) from None
    return chosen


def _missing(run_id: str, step: int, listed: list[Stored], anywhere: bool) -> str:
    kinds = (CHAIN, ABANDONED) if anywhere else (CHAIN,)
    steps = sorted({s.manifest.step for s in listed if s.status in kinds})
    why = f"run {run_id} has no committed checkpoint at step {step}"
    there = {s.status for s in listed if s.manifest.step == step}
    if ABANDONED in there and not anywhere:
        why += " on its chain (the one stored was abandoned by a rollback: fork from it instead)"
    elif there:
        why += " that was ever committed on its chain (what is stored there is off it)"
    return f"{why}; steps available: {', '.join(map(str, steps)) or 'none'}"
