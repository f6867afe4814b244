"""The job speeds grants by time reckon with, read from a real server's pools bucket: the
median of a queued job name's samples, nothing for a name never measured, and forgotten
once no run of the name is queued or held at a site."""

from __future__ import annotations

import msgspec
from nats.aio.client import Client

from services.dispatcher.queues import Reckoner
from services.dispatcher.speeds import Speeds
from shared import config
from shared.bus import names
from shared.contracts import RunState, encode
from shared.state.pools import JobSpeeds, job_key
from tests.services.dispatcher.test_queues import SPEC, record


async def test_a_queued_jobs_measured_speed_is_read_and_dropped_with_its_last_run(
    declared: Client,
) -> None:
    js = declared.jetstream()
    kv = await js.key_value(names.POOLS_BUCKET)
    await kv.put(job_key("default", "n"), encode(JobSpeeds(samples=[0.3, 0.1, 0.2])))
    r = Reckoner(config.load({}))
    other = msgspec.structs.replace(SPEC, name="never-measured")
    r.observe(record("a.r1", 1.0), 1)
    r.observe(record("a.r2", 2.0, spec=other), 2)
    speeds = Speeds(js, r)
    await speeds.refresh("default")
    assert r.speeds["default"] == {"n": 0.2}
    # Its last run ended: the name is no longer read, nor reckoned with.
    r.observe(record("a.r1", 1.0, state=RunState.CANCELLED), 3)
    await speeds.refresh("default")
    assert r.speeds["default"] == {}
