"""The history checker (`shared.history.verify`, docs/verify.md) run over a stack a test
started: every invariant of its whole history, read at the hub and in the store."""

from __future__ import annotations

from nats.aio.client import Client

from shared.checkpoint.store import open_store
from shared.history.collect import collect
from shared.history.verify import check, describe
from tests.support.stack import Stack


async def findings(stack: Stack, nc: Client | None = None, *, settled: bool = False) -> list[str]:
    """Each invariant the stack's history breaks, said in a line; `settled`: every ended
    run with a price must be settled already."""
    nc = nc or await stack.client()
    async with open_store(stack.store_url) as store:
        history = await collect(nc, store)
    return [describe(v) for v in check(history, settled_exactly=settled)]


async def no_violation(stack: Stack, nc: Client | None = None, *, settled: bool = False) -> None:
    """Fail, naming each, if the stack's history breaks any invariant."""
    found = await findings(stack, nc, settled=settled)
    assert not found, "the history breaks invariants:\n" + "\n".join(found)
