"""`baton verify` as an operator runs it, against a hub under `baton up`'s authorization: the
operator's credentials read every stream and bucket of the history (the hub's log is
audited: nothing refused), a clean history exits 0, and a planted violation is printed — and
given as JSON — with exit code 1."""

from __future__ import annotations

import json
from pathlib import Path

from shared.bus.emit import emit
from shared.contracts.events import Accepted
from tests.support.cli import authorized_hub, baton_as


async def test_baton_verify_says_no_violation_then_the_one_planted(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    async with authorized_hub(tmp_path / "hub") as hub:
        code, out, err = await baton_as(hub, "operator", "verify", "--store", store)
        assert code == 0 and out.startswith("no violation (0 runs, 0 events"), (code, out, err)

        # An `accepted` as the dispatcher publishes it, for a run whose record never was.
        dispatcher = await hub.connect("dispatcher")
        lost = Accepted(run_id="rlost", name="t", pool="default", total_steps=1)
        await emit(dispatcher.jetstream(), lost)

        code, out, err = await baton_as(hub, "operator", "verify", "--store", store)
        assert code == 1, (code, out, err)
        assert "[run-kept] run rlost was accepted but has no record" in out, out
        assert out.rstrip().endswith("1 violation"), out
        code, out, err = await baton_as(hub, "operator", "verify", "--store", store, "--json")
        assert code == 1, (code, out, err)
        doc = json.loads(out)
        assert doc["ok"] is False and (doc["runs"], doc["events"]) == (1, 1), doc
        (found,) = doc["violations"]
        assert found["invariant"] == "run-kept" and found["runs"] == ["rlost"], found
