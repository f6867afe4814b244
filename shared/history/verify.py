"""The history checker: every invariant of a stack's history, checked in one call.

Invariant: `check` is pure — a function of the `History` it is given and its options alone —
and runs every invariant of `shared.history.invariants` and `shared.history.accounts`, each
once, in the order docs/verify.md lists them; an empty list means no invariant is broken.
Reading a stack into a `History` is `shared.history.collect`'s, apart from this.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.history import accounts, invariants
from shared.history.facts import History, Violation

Check = Callable[[History], list[Violation]]

CHECKS: tuple[tuple[str, Check], ...] = (
    (invariants.RUN_KEPT, invariants.run_kept),
    (invariants.ENDS_STAY, invariants.ends_stay),
    (invariants.END_TOLD, invariants.end_told),
    (invariants.COMPLETED_ONCE, invariants.completed_once),
    (invariants.COMPLETED_DIGEST, invariants.completed_digest),
    (invariants.FINAL_LAST, invariants.final_last),
    (invariants.TOKENS_GROW, invariants.tokens_grow),
    (invariants.TOKEN_ONE_ATTEMPT, invariants.token_one_attempt),
    (accounts.LEDGER_SUMS, accounts.ledger_sums),
    (accounts.SETTLED_ONCE, accounts.settled_once),
    (accounts.NOTHING_AFTER_SETTLE, accounts.nothing_after_settle),
    (accounts.TOPUPS_KEPT, accounts.topups_kept),
    (accounts.CHARGED_RIGHT, accounts.charged_right),
    (accounts.PROCESS_ENDS, accounts.process_ends),
)
"""Every invariant by its id, in order."""


def check(
    history: History,
    *,
    settled_exactly: bool = False,
    grace_s: float = accounts.GRACE_S,
) -> list[Violation]:
    """Every violation `history` holds. `settled_exactly`: every ended run with a price must
    be settled already (else at most once); `grace_s`: how long a training process may
    outlive its run's end."""
    out: list[Violation] = []
    for name, fn in CHECKS:
        if name == accounts.SETTLED_ONCE:
            out += accounts.settled_once(history, exactly=settled_exactly)
        elif name == accounts.PROCESS_ENDS:
            out += accounts.process_ends(history, grace_s)
        else:
            out += fn(history)
    return out


def describe(violation: Violation) -> str:
    """One line for people: `[id] sentence (entries)`."""
    shown = f" ({', '.join(violation.entries)})" if violation.entries else ""
    return f"[{violation.invariant}] {violation.detail}{shown}"
