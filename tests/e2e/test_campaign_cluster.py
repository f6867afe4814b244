"""The fault campaign on a hub of three nodes with the site lab1 (`tests.support.campaign`):
a seeded schedule of submits (at the hub, by a person in the priced pool, at a priority
that preempts, the same job at the hub and at the cut-off site), cancels, pauses, rollbacks,
forks and top-ups, against trainers SIGKILLed, SIGSTOPped and SIGTERMed, the site's link
cut and hub nodes SIGKILLed or SIGSTOPped one at a time; then every run ends with its
uninterrupted weights, completes once, and the history checker finds nothing.

`BATON_CAMPAIGN_SEED=<n>` runs that seed alone, `BATON_CAMPAIGN_S` sets the schedule's
length (docs/verify.md, "The fault campaign")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.campaign import CLUSTER, length_s, run_campaign, seeds

pytestmark = [pytest.mark.adversary, pytest.mark.timeout(int(length_s()) + 900)]


@pytest.mark.parametrize("seed", seeds((3,)))
async def test_campaign_clustered_hub(tmp_path: Path, seed: int) -> None:
    await run_campaign(tmp_path / "campaign", CLUSTER, seed)
