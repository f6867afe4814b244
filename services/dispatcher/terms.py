"""What a pool's table makes of a job as its owner submits it: its priority, its credits."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.contracts.jobs import JobSpec
from shared.contracts.pools import Pool
from shared.errors import ContractError


@dataclass(frozen=True)
class Terms:
    priority: int
    budget: tuple[float | None, float | None] = (None, None)
    """The estimated cost (`limits.max_cost`'s unit) and the hard timeout it allows."""
    price: dict[str, float] = field(default_factory=dict)
    """The pool's price, for a run whose credits are held (empty: it costs none)."""
    hold: int = 0
    """Units held for each of its runs."""


def resolve_priority(spec: JobSpec, pool: Pool, owner: str) -> int:
    """The job's priority as a number: its own, the class it names, or the pool's default;
    `ContractError` for a class the pool does not name or a priority above the owner's
    highest (an operator's run may use any)."""
    asked = spec.priority
    if asked is None:
        value = pool.default_priority
    elif isinstance(asked, str):
        if asked not in pool.priorities:
            known = ", ".join(f"{k} ({v})" for k, v in sorted(pool.priorities.items())) or "none"
            raise ContractError(
                f"priority {asked!r} is not a class of pool {spec.pool!r} (its classes: {known})",
                "$.priority",
            )
        value = pool.priorities[asked]
    else:
        value = asked
    highest = pool.highest_priority(owner)
    if highest is not None and value > highest:
        raise ContractError(
            f"priority {value} is above the highest {owner} may use on pool {spec.pool!r} "
            f"({highest})",
            "$.priority",
        )
    return value
