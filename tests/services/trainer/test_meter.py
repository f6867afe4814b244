"""A run's credits as it trains (`services/trainer/meter.py`): it is warned at 80 % of what
its holds pay for and paused when they are spent, counting its earlier attempts' time and
its ranks; a run without a price is never metered."""

from __future__ import annotations

import asyncio

import msgspec

from services.trainer.meter import Meter
from shared.contracts import JobSpec, RunRecord, convert, spec_hash
from shared.contracts.pools import units

SPEC = convert({"name": "n", "entry_point": "m:f", "total_steps": 10}, JobSpec)


def record(**fields: object) -> RunRecord:
    base = RunRecord(run_id="a.r1", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=0.0,
                     updated_at=0.0)  # fmt: skip
    return msgspec.structs.replace(base, **fields)


async def test_a_run_is_warned_then_paused_when_its_holds_are_spent() -> None:
    # 1.0 trainer-second affordable at 1 credit/s; 0.4 used by earlier attempts; 2 ranks:
    # 0.3 s of this attempt's time spends it.
    r = record(price={"cpu": 1.0}, holds=[units(0.6), units(0.4)], metered_s=0.4)
    meter = Meter(r, "cpu", ranks=2)
    assert meter.affordable_s() == 1.0
    paused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    warned: list[str] = []

    async def warn(detail: str) -> None:
        warned.append(detail)

    watching = asyncio.create_task(meter.watch(paused.set_result, warn))
    meter.start()
    reason = await asyncio.wait_for(paused, 10)
    await watching
    assert reason.startswith("budget: its hold of 1 credits is spent"), reason
    assert len(warned) == 1 and "of the 1 trainer-seconds" in warned[0], warned
    assert meter.trained_s() >= 0.6 - 1e-6  # 2 ranks: twice the wall time


async def test_a_run_without_a_price_is_never_metered() -> None:
    meter = Meter(record(), "cuda", ranks=1)
    assert not meter.active

    def never(reason: str) -> None:
        raise AssertionError(reason)

    async def quiet(detail: str) -> None:
        raise AssertionError(detail)

    await meter.watch(never, quiet)  # returns at once
    cuda_only = Meter(record(price={"cuda": 1.0}, holds=[1]), "cpu", ranks=1)
    assert not cuda_only.active  # no price for this device kind, none for `*`
