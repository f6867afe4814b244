"""A site cut off from the hub: its trainer's log says so once, and the CLI at the site says
what it cannot answer in one line.

The hub (nats-server in domain `hub`, dispatcher, checkpointer, reaper) and the site `lab1`
(leaf nats-server behind a `Proxy`, its checkpointer and one trainer) are real processes,
and so is every `baton` command (`python -m baton`, pointed at the site's leaf with the
site operator's credentials). The cut lasts until the hub has seen the lease lapse and the
site trained on: several renewal intervals, each of which used to log a line per retry.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.bus import names
from shared.contracts import decode
from shared.contracts.events import Progress, Started
from shared.state.lease import holder
from tests.e2e.jobs import EventLog, paced, submit
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

TTL = 6
HUB_ONLY = ("dispatcher", "checkpointer", "reaper")
TRAINER = "lab1-trainer-1"
ABOUT_THE_CUT = re.compile(
    r"lease renewal|not confirmed|publishes to|not reachable|recovered after",
    re.IGNORECASE,
)
"""The trainer's log lines about what a cut makes fail, and about its recovery."""
MOST_LINES = 6
"""A handful: the renewals' start and recovery, the publishes' start and recovery, slack."""


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    # Runs held by the hub (no grants): the path whose cut the trainer's log must say once.
    s = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL, env={"BATON_DELEGATE_AHEAD": "0"})
    await s.start(HUB_ONLY)
    try:
        yield s
    finally:
        await s.stop()


def one_line_error(args: tuple[str, ...], got: tuple[int, str, str]) -> str:
    """The command failed with one line on stderr and no traceback; that line."""
    code, out, err = got
    assert code != 0, f"baton {' '.join(args)} exited 0 while cut off: {out}"
    assert "Traceback" not in err, f"baton {' '.join(args)}: {err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"baton {' '.join(args)} said more than one line: {err}"
    return lines[0]


def about_the_cut(log: str) -> list[str]:
    """The lines of `log` about the cut, DEBUG ones aside (the tests' services log at DEBUG;
    a deployment's at INFO)."""
    return [
        line for line in log.splitlines() if ABOUT_THE_CUT.search(line) and " DEBUG " not in line
    ]


async def progressed_at_site(site: Site, run_id: str, beyond: int) -> int | None:
    """The newest step the site's outbox has for the run, once it is past `beyond`."""
    sent = await site.outbox(names.at_site(names.event_subject(run_id, "progress"), site.name))
    steps = [decode(d, Progress).step for _, d in sent]
    return max(steps) if steps and max(steps) > beyond else None


async def test_a_cut_off_site_logs_once_and_its_cli_says_why(hub: Stack) -> None:
    site = Site(hub, "lab1")
    await site.start(trainers=1)
    nc = await hub.client()
    run_id = await submit(nc, paced(1500))
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Started), 30, "the run to start at the site")
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 10, 30, "step 10")
    seen = max(e.step for e in log.of(Progress))
    before = len(hub.log(TRAINER).splitlines())

    site.proxy.sever()
    js = nc.jetstream()
    key = hub.lease_key(run_id)

    async def lapsed() -> bool:
        return await holder(js, key) is None

    # Several renewal intervals (TTL/3) and the 0.5 s retries between them, while the
    # trainer trains on.
    await eventually(lapsed, 3 * TTL, "the lease to lapse at the hub")
    lapse = await eventually(lambda: progressed_at_site(site, run_id, seen), 30, "training on")
    assert lapse is not None
    # 100 steps of 0.05 s more: at least 5 s, several renewal intervals after the lapse.
    await eventually(lambda: progressed_at_site(site, run_id, lapse + 100), 60, "training on")

    line = one_line_error(("status", run_id), await site.cli("status", run_id))
    assert "the hub is unreachable from this site (cut off?)" in line, line
    # What the site holds itself is answered: its own runs (none granted here), with a
    # note of what is left out, and its trainers.
    code, out, err = await site.cli("runs", "--json")
    assert code == 0 and run_id not in out and "Traceback" not in err, (code, out, err)
    assert "the hub is unreachable from this site" in err, err
    code, out, err = await site.cli("workers", "--json")
    assert code == 0 and TRAINER in out, (code, out, err)
    code, out, err = await site.cli("streams", "--json")  # the site's own: answered
    assert code == 0 and "BATON_OUTBOX" in out, (code, out, err)

    cut = about_the_cut("\n".join(hub.log(TRAINER).splitlines()[before:]))
    site.proxy.restore()

    async def recovered() -> bool:
        return "lease renewal recovered after" in hub.log(TRAINER)

    await eventually(recovered, 30, "the trainer to log its recovery")
    lines = about_the_cut("\n".join(hub.log(TRAINER).splitlines()[before:]))
    print(f"\n{len(cut)} lines about the cut while cut, {len(lines)} in all", *lines, sep="\n  ")
    assert len(lines) <= MOST_LINES, "\n".join(lines)
    began = [line for line in cut if " WARNING " in line and "lease renewal failed (" in line]
    assert len(began) == 1, cut
    ended = [line for line in lines if " INFO " in line and "lease renewal recovered" in line]
    assert len(ended) == 1, lines

    # Restored: the hub's runs are read across the link again.
    code, out, err = await site.cli("runs", "--json")
    assert code == 0 and run_id in out and "Traceback" not in err, (code, out, err)
    code, out, err = await site.cli("status", run_id)
    assert code == 0 and run_id in out and "not readable from this site" in out, (code, out, err)
    log.close()
