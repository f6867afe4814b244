"""Whose chain a commit extends, as the checkpointer that commits it says (`side_of`)."""

from __future__ import annotations

import pytest

from services.checkpointer.service import side_of
from shared.contracts import CommitRequest
from shared.errors import ContractError


def request(side: str | None) -> CommitRequest:
    return CommitRequest(run_id="r1", token=1, step=10, worker="w", files=[], side=side)


@pytest.mark.parametrize(
    ("side", "site", "written"),
    [
        (None, "", ""),  # a trainer from before sides: the checkpointer's own
        (None, "lab1", "lab1"),
        ("", "", ""),
        ("lab1", "lab1", "lab1"),  # a run granted to lab1
        ("", "lab1", ""),  # a hub task lab1's trainer took: the hub's chain
    ],
)
def test_a_commit_extends_its_attempts_side(side: str | None, site: str, written: str) -> None:
    assert side_of(request(side), site) == written


@pytest.mark.parametrize(("side", "site"), [("lab2", "lab1"), ("lab1", "")])
def test_a_commit_for_another_side_is_refused(side: str, site: str) -> None:
    with pytest.raises(ContractError, match=repr(side)):
        side_of(request(side), site)
