"""Grants to sites without NATS: the token order across authorities, the store fence a
taking back writes, and the record transitions of granting, taking back and reconciling."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save

from shared.checkpoint import commit
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, FileRef, RunState
from shared.contracts.jobs import RankRange
from shared.errors import StaleToken
from shared.state import grants
from shared.state import transitions as t
from tests.shared.state.test_transitions import SPEC, applied, changed, record, refused, terminal

QUEUED = record(
    state=RunState.QUEUED, worker=None, token=3, delivery=None, group=[], admitted=False
)
"""Queued and waiting for the scheduler, which grants it."""


def test_tokens_order_by_epoch_before_revision() -> None:
    hub_late = grants.token_of(0, 2**32 - 1)
    site_early = grants.token_of(1, 1)
    taken_back = grants.token_of(2, 1)
    assert hub_late < site_early < taken_back
    assert grants.epoch_of(site_early) == 1 and grants.epoch_of(hub_late) == 0
    assert grants.token_of(0, 7) == 7, "the hub's tokens before any grant are revisions"
    with pytest.raises(AssertionError):
        grants.token_of(1, 2**32)


async def _commit(store: FileStore, token: int, step: int, final: bool = False) -> None:
    payload = save({"w": torch.full((4,), float(step))})
    key = commit.data_key("r", token, step, "model.safetensors")
    await store.put_once(key, payload)
    ref = FileRef(
        name="model.safetensors", key=key, size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )  # fmt: skip
    req = CommitRequest(run_id="r", token=token, step=step, worker="w", files=[ref], final=final)
    await commit.commit(store, req)


async def test_a_fence_refuses_every_later_commit_of_the_revoked_grant(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    site = grants.token_of(1, 4)
    await _commit(store, site, 10)
    assert await grants.fence(store, "r", 2)
    latest = await commit.read_latest(store, "r")
    assert latest is not None
    assert latest[0].token == grants.token_of(2, 0) and latest[0].step == 10
    assert latest[0].manifest == commit.manifest_key("r", 10, site), "the same checkpoint"
    with pytest.raises(StaleToken):
        await _commit(store, site, 20)  # the site, still training: refused
    await _commit(store, grants.token_of(2, 1), 20)  # the hub's next holder: accepted
    assert await grants.fence(store, "r", 2), "fenced already: nothing to do"


async def test_a_fence_alone_before_any_checkpoint_refuses_the_revoked_grants_first(
    tmp_path: Path,
) -> None:
    """No checkpoint yet: `latest` becomes a fence naming none, which the revoked grant's
    first commit (its final one, say) cannot supersede; the new epoch's first commit can,
    and starts the chain. Nothing is restorable from the fence itself."""
    store = FileStore(tmp_path)
    assert await grants.fence(store, "r", 2)
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0].checkpoint is None, latest
    assert latest[0].token == grants.token_of(2, 0) and latest[0].step == 0
    assert await commit.restorable(store, "r") == (None, [])
    with pytest.raises(StaleToken):
        await _commit(store, grants.token_of(1, 4), 400, final=True)
    await _commit(store, grants.token_of(2, 1), 20)
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0].checkpoint == commit.manifest_key(
        "r", 20, grants.token_of(2, 1)
    )
    manifest = await commit.load_manifest(store, latest[0].manifest)
    assert manifest.previous is None, "the chain starts at the new epoch's first commit"
    assert await grants.fence(store, "r", 2), "fenced already: nothing to do"


async def test_no_fence_over_a_final_checkpoint(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await _commit(store, grants.token_of(1, 1), 50, final=True)
    assert not await grants.fence(store, "r", 2), "trained to the end: not taken back"
    latest = await commit.read_latest(store, "r")
    assert latest is not None and latest[0].token == grants.token_of(1, 1)


def test_delegate_grants_a_queued_run_under_the_next_epoch() -> None:
    new = applied(t.delegate("lab1"), QUEUED)
    assert changed(QUEUED, new) == {"site": "lab1", "epoch": 1, "admitted": True}
    group = msgspec.structs.replace(QUEUED, spec=msgspec.structs.replace(SPEC, ranks=2))
    assert applied(t.delegate("lab1"), group).site == "lab1"
    # An elastic run's size is then the site's: the hub's cap, if it had one, is not.
    elastic = msgspec.structs.replace(SPEC, ranks=RankRange(min=1, max=2))
    capped = msgspec.structs.replace(QUEUED, spec=elastic, ranks_cap=1)
    granted = applied(t.delegate("lab1"), capped)
    assert granted.site == "lab1" and granted.ranks_cap is None, granted
    refused(
        t.delegate("lab1"), record(), new,
        msgspec.structs.replace(QUEUED, cancel_requested="x"),
        msgspec.structs.replace(QUEUED, pause_requested="x"),
        msgspec.structs.replace(QUEUED, rollback_to=10), *terminal(),
    )  # fmt: skip


def test_take_back_queues_the_run_at_the_hub_under_the_next_epoch() -> None:
    granted = record(site="lab1", epoch=1, dispatch=1)
    new = applied(t.take_back("lab1", 1), granted)
    assert new.site == "" and new.epoch == 2 and new.state is RunState.QUEUED
    assert new.dispatch == 2 and new.worker is None and new.group == []
    paused = applied(t.take_back("lab1", 1), record(site="lab1", epoch=1, state=RunState.PAUSED))
    assert paused.state is RunState.PAUSED
    refused(
        t.take_back("lab1", 1), record(site="lab2", epoch=1), record(site="lab1", epoch=2),
        record(), *terminal(site="lab1", epoch=1),
    )  # fmt: skip


def test_reconcile_takes_the_sites_record_only_under_the_granted_epoch() -> None:
    hub = record(site="lab1", epoch=1, state=RunState.QUEUED, cancel_requested="asked at hub")
    reported = record(site="lab1", epoch=1, step=40, attempts=1, updated_at=9.0)
    new = applied(t.reconcile("lab1", reported), hub)
    assert new.step == 40 and new.attempts == 1 and new.state is RunState.RUNNING
    assert new.cancel_requested == "asked at hub", "what the hub was asked is kept"
    assert t.reconcile("lab1", new)(new) is None, "a repeat changes nothing"
    refused(
        t.reconcile("lab1", reported), record(site="lab1", epoch=2),
        record(site="lab2", epoch=1), record(epoch=1),
    )  # fmt: skip
    # An ended record only has its announcement cleared, once the site's is.
    ended = record(site="lab1", epoch=1, state=RunState.COMPLETED, announce_pending=True)
    done = applied(
        t.reconcile("lab1", msgspec.structs.replace(ended, announce_pending=False)), ended
    )
    assert changed(ended, done) == {"announce_pending": False}
    refused(t.reconcile("lab1", ended), ended)


def test_the_same_job_submitted_at_a_site_and_queued_at_the_hub_is_the_sites() -> None:
    at_hub = record(state=RunState.QUEUED, attempts=0, worker=None, token=None)
    at_site = record(site="lab1", epoch=1, state=RunState.COMPLETED, attempts=1)
    assert applied(t.reconcile("lab1", at_site), at_hub) == at_site
    started = msgspec.structs.replace(at_hub, attempts=1)
    other = msgspec.structs.replace(at_site, spec_hash="other")
    refused(t.reconcile("lab1", at_site), started, record(state=RunState.RUNNING))
    refused(t.reconcile("lab1", other), at_hub)


def test_at_the_site_a_newer_grant_replaces_the_record_and_requests_are_copied() -> None:
    kept = record(site="lab1", epoch=1)
    newer = record(site="lab1", epoch=3, state=RunState.QUEUED)
    assert applied(t.accept_grant(newer), kept) == newer
    refused(t.accept_grant(kept), kept, newer)
    hub = record(site="lab1", epoch=1, cancel_requested="stop it")
    assert applied(t.forward_requests(hub), kept).cancel_requested == "stop it"
    refused(
        t.forward_requests(hub), record(site="lab1", epoch=2),
        msgspec.structs.replace(kept, cancel_requested="stop it"), *terminal(site="lab1", epoch=1),
    )  # fmt: skip
    timed_out = record(site="lab1", epoch=1, state=RunState.FAILED, reason="hard_timeout: x")
    ended = applied(t.forward_requests(timed_out), kept)
    assert (ended.state, ended.reason) == (RunState.FAILED, "hard_timeout: x"), ended
    asked = record(site="lab1", epoch=1, checkpoints_asked=2)
    assert applied(t.forward_requests(asked), kept).checkpoints_asked == 2
    refused(t.forward_requests(kept), asked)  # never fewer than the site has served


def test_mark_running_and_the_hubs_requests_respect_the_grant() -> None:
    granted = record(site="lab1", epoch=1, state=RunState.QUEUED, token=None)
    refused(t.mark_running("w", 5, None, []), granted)
    assert applied(t.mark_running("w", 5, None, [], "lab1"), granted).state is RunState.RUNNING
    refused(t.mark_running("w", 5, None, [], "lab1"), record(token=None))
    # Granted, the run is the site's to end: a cancel or a pause is asked, not done.
    assert applied(t.cancel("x"), granted).cancel_requested == "x"
    assert applied(t.cancel("x"), granted).state is RunState.QUEUED
    assert applied(t.pause("x"), granted).pause_requested == "x"


LAB1 = grants.site_epoch("lab1")


def test_a_run_the_hub_ran_too_is_the_sites_only_where_the_store_chose_it() -> None:
    """The same job at both sides of a cut: the hub's record gives way to the site's report
    when the store's chain is the site's (`owns`), keeping the hub copy's credits; else the
    report is not taken in."""
    running = record(state=RunState.RUNNING, token=5, step=30)
    at_site = record(site="lab1", epoch=LAB1, state=RunState.COMPLETED, token=LAB1 << 32 | 4)
    assert applied(t.reconcile("lab1", at_site, owns=True), running) == at_site
    refused(t.reconcile("lab1", at_site), running)  # the store did not choose it
    refused(
        t.reconcile("lab1", at_site, owns=True), *terminal(),  # the hub's ended first
        msgspec.structs.replace(running, spec_hash="other"),  # another job under the key
        record(site="lab2", epoch=LAB1 + 1),  # a later epoch than the site's
    )  # fmt: skip


def test_an_attempt_that_yields_leaves_the_run_to_the_side_the_store_names() -> None:
    mine = record(state=RunState.RUNNING, token=7, worker="w")
    at_hub = applied(t.yield_to(7, "lab1", LAB1), mine)
    assert (at_hub.site, at_hub.epoch, at_hub.worker, at_hub.state) == (
        "lab1", LAB1, None, RunState.RUNNING
    ), at_hub
    at_site = applied(t.yield_to(7, "", 0, side="lab1"), mine)
    said = {"worker": None, "delivery": None, "reason": "trained by the hub"}
    assert changed(mine, at_site) == said, at_site
    refused(t.yield_to(7, "lab1", LAB1), record(token=8), *terminal(token=7))


def test_a_token_the_hub_forgot_moves_the_runs_epoch_past_the_stores() -> None:
    mine = record(state=RunState.RUNNING, token=7, worker="w", epoch=0)
    moved = applied(t.past_store(7, 3), mine)
    assert (moved.epoch, moved.worker, moved.state) == (3, None, RunState.RUNNING), moved
    refused(t.past_store(7, 3), record(token=8), *terminal(token=7))


def test_a_grant_whose_chain_the_hub_finished_completes_from_the_store() -> None:
    """The site yields to another side's final chain and never completes it: the record
    follows the store, once, while it still names that grant."""
    granted = record(state=RunState.RUNNING, site="lab1", epoch=LAB1, worker=None, step=40)
    done = applied(t.complete_from_store("lab1", LAB1, 90, "d" * 64, {"loss": 0.5}), granted)
    assert (done.state, done.step, done.digest, done.metrics, done.worker) == (
        RunState.COMPLETED, 90, "d" * 64, {"loss": 0.5}, None
    ), done
    refused(
        t.complete_from_store("lab1", LAB1, 90, "d" * 64, {}),
        *terminal(site="lab1", epoch=LAB1),
        record(site="lab1", epoch=LAB1 + 1),  # taken back and granted again since
        record(site="", epoch=LAB1),
    )  # fmt: skip


def test_a_grant_whose_chain_the_hub_sealed_ends_as_the_store_says() -> None:
    granted = record(state=RunState.RUNNING, site="lab1", epoch=LAB1, worker=None)
    ended = applied(t.end_granted("lab1", LAB1, RunState.CANCELLED, "sealed"), granted)
    assert (ended.state, ended.reason, ended.worker) == (RunState.CANCELLED, "sealed", None)
    refused(
        t.end_granted("lab1", LAB1, RunState.CANCELLED, "sealed"),
        *terminal(site="lab1", epoch=LAB1), record(site="lab1", epoch=LAB1 + 1),
    )  # fmt: skip


def test_a_sites_reports_keep_what_the_hubs_ledger_holds_for_the_run() -> None:
    """The site's record of a run holds no credits: taking its reports in never drops the
    price and holds the hub's copy took at submit, which settle the run when it ends."""
    price, holds = {"cpu": 0.01}, [500, 200]
    hub = record(site="lab1", epoch=1, state=RunState.RUNNING, price=price, holds=holds)
    reported = record(site="lab1", epoch=1, step=40, attempts=1, updated_at=9.0)
    new = applied(t.reconcile("lab1", reported), hub)
    assert (new.step, new.price, new.holds) == (40, price, holds), new
