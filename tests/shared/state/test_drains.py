"""The drains bucket under `baton up`'s authorization: operators and the dashboard drain and
undrain, a trainer reads its key and can write none."""

from __future__ import annotations

import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from shared.bus import names
from shared.contracts import encode
from shared.contracts.control import Drain
from shared.errors import ContractError
from shared.state.drains import Drains, check_worker
from tests.support.roles import AuthorizedHub


async def test_a_drain_is_a_key_until_undrained(authorized: AuthorizedHub) -> None:
    operator = Drains((await authorized.connect("operator")).jetstream())
    trainer = Drains((await authorized.connect("trainer")).jetstream())
    assert await trainer.get("t1") is None
    await operator.drain(Drain(worker="t1", reason="disk swap", at=1.0))
    assert await trainer.get("t1") == Drain(worker="t1", reason="disk swap", at=1.0)
    assert await trainer.get("t2") is None, "one key per worker"
    assert await operator.undrain("t1")
    assert await trainer.get("t1") is None
    assert not await operator.undrain("t1"), "undraining twice says it was not drained"


async def test_the_dashboard_may_drain_and_a_trainer_may_not(authorized: AuthorizedHub) -> None:
    dashboard = Drains((await authorized.connect("dashboard")).jetstream())
    await dashboard.drain(Drain(worker="t1", at=2.0))
    assert (await dashboard.get("t1")) is not None
    assert await dashboard.undrain("t1")

    authorized.audit.allow_server(
        rf"Publish Violation.*\$KV\.{names.DRAINS_BUCKET}\.t2",
        "a trainer writing a drain key is refused on purpose",
    )
    trainer = await authorized.connect("trainer")
    with pytest.raises((NatsTimeoutError, TimeoutError)):  # refused: no ack ever comes
        await trainer.jetstream().publish(
            f"$KV.{names.DRAINS_BUCKET}.t2", encode(Drain(worker="t2", at=3.0)), timeout=1
        )
    operator = Drains((await authorized.connect("operator")).jetstream())
    assert await operator.get("t2") is None


async def test_an_unreadable_record_still_drains(authorized: AuthorizedHub) -> None:
    """Written by hand, say with the nats CLI: the operator meant to drain it."""
    js = (await authorized.connect("operator")).jetstream()
    await js.publish(f"$KV.{names.DRAINS_BUCKET}.t3", b"yes")
    found = await Drains(js).get("t3")
    assert found is not None and found.worker == "t3"


@pytest.mark.parametrize("bad", ["", "*", ">", "a b", "a.*", ".a", "a.", "ü"])
def test_a_worker_id_that_cannot_be_a_key_is_refused(bad: str) -> None:
    with pytest.raises(ContractError):
        check_worker(bad)


def test_worker_ids_as_trainers_have_them_are_keys() -> None:
    for good in ("trainer-1", "lab1-trainer-2", "gpu01.example.org-4121", "t_3"):
        assert check_worker(good) == good
