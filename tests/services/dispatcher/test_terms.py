"""A job's priority under its pool's table: its own number, a class its pool names, or the
default; refused above its owner's highest, or for a class the pool lacks; any for an
operator's run."""

from __future__ import annotations

import pytest

from services.dispatcher.terms import resolve_priority
from shared.contracts import JobSpec, convert
from shared.contracts.pools import Owner, Pool
from shared.errors import ContractError

POOL = Pool(
    priorities={"low": -5, "high": 10}, default_priority=1, max_priority=2,
    owners={"alice": Owner(max_priority=10)},
)  # fmt: skip


def spec(priority: object = None) -> JobSpec:
    raw: dict[str, object] = {"name": "n", "entry_point": "m:f", "total_steps": 1}
    if priority is not None:
        raw["priority"] = priority
    return convert(raw, JobSpec)


def test_a_number_a_class_or_the_default() -> None:
    assert resolve_priority(spec(), POOL, "bob") == 1
    assert resolve_priority(spec("low"), POOL, "bob") == -5
    assert resolve_priority(spec("high"), POOL, "alice") == 10
    assert resolve_priority(spec(2), POOL, "bob") == 2


def test_above_the_owners_highest_or_an_unknown_class_is_refused() -> None:
    with pytest.raises(ContractError, match=r"above the highest bob may use .* \(2\)") as e:
        resolve_priority(spec("high"), POOL, "bob")
    assert e.value.path == "$.priority"
    with pytest.raises(ContractError, match=r"'urgent' is not a class .* high \(10\), low"):
        resolve_priority(spec("urgent"), POOL, "alice")
    assert resolve_priority(spec(999), POOL, "") == 999  # an operator's run: any


def test_a_priority_out_of_range_is_refused_by_the_spec_itself() -> None:
    with pytest.raises(ContractError):
        spec(5000)
    with pytest.raises(ContractError):
        spec("not a class!")
