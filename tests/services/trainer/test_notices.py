"""Reading a cloud's notice that this machine is going (`services/trainer/notices.py`),
against a metadata server on loopback that answers each cloud's documented paths and asks
for its headers (`tests/support/metadata.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from services.trainer.drain import Draining
from services.trainer.notices import CLOUDS, Metadata, Notice, watch
from shared.contracts.control import Drain
from tests.support.metadata import MetadataServer
from tests.support.stack import eventually


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    with MetadataServer() as s:
        yield s


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_each_cloud_says_nothing_then_maintenance_then_a_reclaim(
    server: MetadataServer, cloud: str
) -> None:
    metadata = Metadata(cloud, server.url(cloud))
    assert await metadata.look() is None
    server.announce(cloud, "maintenance")
    notice = await metadata.look()
    assert notice is not None and notice.cloud == cloud and not notice.reclaim, notice
    server.announce(cloud, "reclaim")
    notice = await metadata.look()
    assert notice is not None and notice.reclaim, notice
    assert notice.reason.startswith(f"{cloud} reclaim notice: "), notice.reason


async def test_azure_reads_only_the_events_of_this_machine(server: MetadataServer) -> None:
    server.announce("azure", "reclaim")  # another VM's Redeploy comes first in the list
    notice = await Metadata("azure", server.url("azure")).look()
    assert notice is not None and notice.detail.startswith("Preempt not before"), notice


async def test_aws_asks_for_a_session_token_first_and_keeps_it(server: MetadataServer) -> None:
    metadata = Metadata("aws", server.url("aws"))
    for _ in range(3):
        await metadata.look()
    tokens = [p for p in server.asked if p.endswith("/api/token")]
    assert server.asked[0] == "/aws/latest/api/token" and len(tokens) == 1, server.asked


def test_an_unknown_cloud_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="BATON_CLOUD='ibm'"):
        Metadata("ibm")


async def test_a_server_that_does_not_answer_is_looked_at_again(server: MetadataServer) -> None:
    """Refused (no headers: a base URL that misses the cloud's prefix), then right: the
    watch lives on, and obeys the first notice once."""
    metadata = Metadata("gce", server.url("gce").replace("/gce/", "/nowhere/"))
    heard: list[Notice] = []
    stop = asyncio.Event()
    watching = asyncio.create_task(watch(metadata, 0.05, stop, heard.append))

    async def refused_twice() -> bool:
        return len(server.asked) >= 2

    await eventually(refused_twice, 10, "two looks refused")
    assert not watching.done()
    metadata.base = server.url("gce")
    server.announce("gce", "reclaim")
    await asyncio.wait_for(watching, 10)
    assert [n.reclaim for n in heard] == [True], heard


async def test_a_notice_drains_the_trainer_for_good() -> None:
    """The machine's notice drains as an operator's key does, and no undrain lifts it."""
    draining = Draining(None, "w1", asyncio.Event())  # type: ignore[arg-type]  # no reads here
    draining.notice(Drain(worker="w1", reason="gce reclaim notice: x", at=0.0))
    assert draining.drained and draining.leave.is_set()
    draining._set(None)  # the operator's key says undrained
    assert draining.drained and draining.leave.is_set()
    assert draining.record is not None and draining.record.reason.startswith("gce reclaim")
