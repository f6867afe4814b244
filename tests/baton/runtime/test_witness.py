"""A run checks itself: what the steps after a checkpoint reported is kept, and a resume
from that checkpoint that reports anything else, bit for bit, says so once."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton.runtime import witness
from baton.runtime.context import RunContext
from shared.checkpoint import commit
from shared.errors import IntegrityError, NotFound
from tests.baton.harness import RUN, Run, spec


def loop(
    noise: Callable[[int], float] = lambda step: 0.0,
) -> Callable[[RunContext], Callable[[int], None]]:
    """A tiny regression whose loss at each step comes from its (restored) state, plus
    `noise(step)` standing for whatever the checkpoint does not hold."""

    def setup(ctx: RunContext) -> Callable[[int], None]:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.restore(model=model, optimizer=opt)

        def body(step: int) -> None:
            x = torch.randn(8, 2)  # the global RNG: restored with the checkpoint
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean() + noise(step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.report(loss=loss.item(), lr=0.1)
            if step % 4 == 0:
                ctx.report(sometimes=float(step))  # reported on some steps only

        return body

    return setup


def stored(run: Run, step: int) -> list[witness.Row] | None:
    try:
        return witness.decode(asyncio.run(run.store.get(commit.witness_key(RUN, step))), step)
    except NotFound:
        return None


def test_an_exact_resume_emits_nothing_and_the_witness_holds_the_next_steps(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, spec(total=12, every=100))
    first = run.attempt(loop(), until=9, checkpoint_at=5)
    rows = stored(run, 5)
    assert rows is not None and len(rows) == witness.STEPS, rows
    assert [set(r) for r in rows] == [{"loss", "lr"}, {"loss", "lr"}, {"loss", "lr"}], rows
    second = run.attempt(loop())
    assert second.ctx.step == 12
    assert first.divergences() == [] and second.divergences() == []


def test_a_resume_that_is_not_exact_is_reported_once_naming_the_step_and_both_values(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, spec(total=12, every=100))
    run.attempt(loop(), until=9, checkpoint_at=5)
    rows = stored(run, 5)
    assert rows is not None
    # The resumed attempt's second step after the checkpoint (step 7) is off by a hair.
    second = run.attempt(loop(noise=lambda step: 1e-6 if step == 6 else 0.0))
    (found,) = second.divergences()
    assert (found.checkpoint, found.step, found.metric) == (5, 7, "loss"), found
    assert float(found.expected) == rows[1]["loss"], (found.expected, rows[1])
    assert float(found.got) != float(found.expected) and math.isfinite(float(found.got))


def test_a_deterministic_run_without_a_witness_writes_one_and_others_do_not_check(
    tmp_path: Path,
) -> None:
    """Dying within the window leaves no witness: the resumed attempt writes it. A job
    that is not deterministic keeps none and checks nothing."""
    run = Run(tmp_path, spec(total=12, every=100))
    run.attempt(loop(), until=7, checkpoint_at=5)
    assert stored(run, 5) is None, "a witness of fewer steps than the window was written"
    run.attempt(loop(), until=10)
    assert stored(run, 5) is not None, "the resumed attempt wrote no witness"

    loose = Run(tmp_path / "loose", spec(total=12, every=100, deterministic=False))
    loose.attempt(loop(), until=9, checkpoint_at=5)
    second = loose.attempt(loop(noise=lambda step: 1.0))
    assert stored(loose, 5) is None and second.divergences() == []


def test_witness_rows_round_trip_exactly_and_bad_ones_are_refused() -> None:
    rows = [{"loss": 0.1 + 0.2, "nan": math.nan, "inf": -math.inf, "zero": -0.0}]
    back = witness.decode(witness.encode(rows), 5)
    assert all(witness.same(rows[0][k], back[0][k]) for k in rows[0]), back
    assert not witness.same(0.0, -0.0) and witness.same(math.nan, math.nan)
    for bad in (b"{", b'[{"loss": 3}]', b'[{"loss": "zz"}]', witness.encode([{}] * 9)):
        with pytest.raises(IntegrityError, match="witness of checkpoint 5"):
            witness.decode(bad, 5)
