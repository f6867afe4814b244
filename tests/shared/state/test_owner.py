"""Whose run it is, as the store says (`shared.state.owner`): the module's table, row by row."""

from __future__ import annotations

import msgspec

from shared.contracts import Pointer
from shared.state import grants
from shared.state.owner import Decision, Ownership, decide, wins_report

LAB1 = grants.site_epoch("lab1")


def pointer(token: int, *, site: str = "", final: bool = False, step: int = 10) -> Pointer:
    return Pointer(
        run_id="r", token=token, step=step, manifest=f"m/{token}/{step}", final=final, site=site
    )


def test_no_chain_or_an_older_token_of_this_side_trains() -> None:
    assert decide("", grants.token_of(0, 9), None) == Ownership(Decision.TRAIN)
    assert decide("", grants.token_of(0, 9), pointer(grants.token_of(0, 4))).decision is (
        Decision.TRAIN
    )
    # A fence the hub wrote when it took the run back, below the new epoch's tokens.
    fence = pointer(grants.token_of(3, 0), step=0)
    assert decide("", grants.token_of(3, 1), fence).decision is Decision.TRAIN


def test_a_chain_ending_in_this_sides_final_commit_completes_the_run() -> None:
    latest = pointer(grants.token_of(0, 4), final=True)
    assert decide("", grants.token_of(0, 9), latest) == Ownership(Decision.COMPLETE)


def test_another_sides_chain_under_a_higher_epoch_is_theirs() -> None:
    latest = pointer(grants.token_of(LAB1, 3), site="lab1")
    said = decide("", grants.token_of(0, 9), latest)
    assert said == Ownership(Decision.YIELD, site="lab1", epoch=LAB1), said


def test_another_sides_final_chain_is_theirs_whatever_its_epoch() -> None:
    """The hub finished first under epoch 0: the site (under its own, higher epoch) yields."""
    latest = pointer(grants.token_of(0, 4), final=True)
    said = decide("lab1", grants.token_of(LAB1, 2), latest)
    assert said == Ownership(Decision.YIELD, site="", epoch=0), said


def test_a_sealed_end_stops_every_attempt() -> None:
    """Cancelled at the hub (`commit.seal`): a site's attempt under its own, higher epoch,
    and any attempt of the hub, trains nothing."""
    sealed = msgspec.structs.replace(pointer(grants.token_of(0, 4)), ended="cancelled")
    for side, token in (("lab1", grants.token_of(LAB1, 2)), ("", grants.token_of(0, 9))):
        said = decide(side, token, sealed)
        assert said == Ownership(Decision.ENDED, site="", epoch=0), said


def test_another_sides_lower_epoch_is_not_the_runs_yet() -> None:
    """The hub's chain under epoch 0, the site's attempt under its own higher epoch: the
    site trains, and its first commit takes the chain over."""
    latest = pointer(grants.token_of(0, 4))
    assert decide("lab1", grants.token_of(LAB1, 2), latest).decision is Decision.TRAIN


def test_a_token_at_or_below_the_stores_own_is_one_the_hub_forgot() -> None:
    for stored in (grants.token_of(2, 9), grants.token_of(2, 12), grants.token_of(3, 1)):
        said = decide("", grants.token_of(2, 9), pointer(stored))
        assert said == Ownership(Decision.FORGOTTEN, epoch=grants.epoch_of(stored) + 1), said


def test_a_sites_report_wins_only_where_its_chain_is() -> None:
    mine = pointer(grants.token_of(LAB1, 3), site="lab1")
    assert wins_report("lab1", LAB1, mine)
    assert not wins_report("lab2", LAB1, mine)
    assert not wins_report("lab1", LAB1 + 1, mine)
    assert not wins_report("lab1", LAB1, pointer(grants.token_of(0, 3)))
    assert not wins_report("lab1", LAB1, None)


def test_site_epochs_are_above_the_hubs_count_and_apart() -> None:
    sites = [f"site{i}" for i in range(200)] + ["lab1", "lab2", "edge"]
    epochs = {s: grants.site_epoch(s) for s in sites}
    assert len(set(epochs.values())) == len(sites), "two sites' epochs met"
    for e in epochs.values():
        assert grants.SITE_EPOCHS <= e < 1 << 31, e
        assert (e - grants.SITE_EPOCHS) % grants.SITE_EPOCH_SPACING == 0, e
    assert grants.site_epoch("lab1") == grants.site_epoch("lab1")
