"""A client that knows only docs/submitting.md, "Submitting from any NATS client": the page's
Python block, loaded as it stands, submits as the stack's submitter and follows its run to
COMPLETED; and what the section says is refused is refused.

The client part is that block alone (raw nats-py, hashlib); Baton's own code is used here
only to check from the operator's side what the client did.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import nats
import nats.errors
import pytest

from shared.bus import names
from shared.contracts import RunState, run_id_for
from shared.contracts.events import Accepted
from tests.e2e.jobs import finished, history
from tests.support.stack import REPO, Stack, eventually

SECTION = "# Submitting from any NATS client"
PAGE = "docs/submitting.md"
OTHERS = "baton.events.alice.>"
"""Events of another submitter's runs."""


def readme_client(tmp_path: Path) -> ModuleType:
    """The page's Python block, imported as a module."""
    text = (REPO / PAGE).read_text()
    section = re.split(r"\n#{2,} ", text.split(SECTION, 1)[1], maxsplit=1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, f"no Python block in {PAGE}'s {SECTION!r}"
    path = tmp_path / "readme_client.py"
    path.write_text(found.group(1))
    spec = importlib.util.spec_from_file_location("readme_client", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def submitter_credentials(stack: Stack) -> tuple[str, str]:
    """NATS_USER and NATS_PASSWORD from the env file `baton up` wrote for the submitter."""
    values = dict(
        line.split("=", 1)
        for line in (stack.root / "auth" / "submitter.env").read_text().splitlines()
        if "=" in line
    )
    return values["NATS_USER"], values["NATS_PASSWORD"]


def spec(key: str) -> dict[str, Any]:
    """examples/job.toml's job, small."""
    return {
        "name": "foreign-client",
        "entry_point": "examples.regression:train",
        "pool": "default",
        "total_steps": 40,
        "seed": 7,
        "deterministic": True,
        "checkpoint": {"every_steps": 20},
        "config": {"hidden": 32, "batch": 32},
        "idempotency_key": key,
    }


def test_readme_run_id_rule_is_the_dispatchers(tmp_path: Path) -> None:
    client = readme_client(tmp_path)
    for user, key in [("submitter", "k"), ("alice", uuid.uuid4().hex), ("bob", "a-b_c.1~")]:
        assert client.run_id_for(user, key) == run_id_for(key, user), (user, key)


async def test_a_raw_client_submits_and_follows_its_run_to_completed(
    stack: Stack, tmp_path: Path
) -> None:
    client = readme_client(tmp_path)
    user, password = submitter_credentials(stack)
    url = stack.nats.url
    key = f"foreign-{uuid.uuid4().hex}"
    job = spec(key)

    nc = await client.connect(url, user, password)
    try:
        run_id, duplicate = await client.submit(nc, user, job)
        assert not duplicate, "the first publish was taken for a retry"
        assert run_id == run_id_for(key, user), run_id
        # A retried publish (same Nats-Msg-Id, within the stream's duplicate window) is
        # dropped by the stream: the dispatcher never sees it.
        again = await client.submit(nc, user, job)
        assert again == (run_id, True), again

        events = [event async for event in client.follow(nc, run_id, 120)]
        types = [e["type"] for e in events]
        assert {e["run_id"] for e in events} == {run_id}, events
        assert types[0] == "accepted" and types[-1] == "completed", types
        assert types.index("started") < types.index("completed"), types
        assert types.count("accepted") == 1 and events[0]["duplicate"] is False, events
        assert events[-1]["step"] == 40, events[-1]

        found = await client.record(nc, run_id)
        assert found is not None and found["state"] == "COMPLETED", found
        assert found["run_id"] == run_id and found["step"] == 40, found
        assert await client.record(nc, f"{user}.r{'0' * 20}") is None

        # Past the window (here: another Nats-Msg-Id), the same key reaches the dispatcher,
        # which answers for the same run.
        await nc.jetstream().publish(
            f"baton.submit.default.{user}",
            json.dumps(job).encode(),
            headers={"Nats-Msg-Id": f"{key}-later"},
        )
    finally:
        await nc.close()

    op = await stack.client()

    async def second_answer() -> list[Accepted] | None:
        accepted = [e for e in await history(op, run_id) if isinstance(e, Accepted)]
        return accepted if len(accepted) == 2 else None

    accepted = await eventually(second_answer, 20, "the dispatcher's answer to the late resubmit")
    assert [a.duplicate for a in accepted] == [False, True], accepted
    assert (await finished(op, run_id)).state is RunState.COMPLETED
    js = op.jetstream()
    # Two submissions stored in all (the retry within the window never was), one run.
    submitted = await js.stream_info(names.SUBMIT_STREAM)
    assert submitted.state.last_seq == 2, submitted.state
    records = await (await js.key_value(names.RUNS_BUCKET)).keys()
    assert records == [run_id], records
    # `follow` removed its consumers.
    left = [c.name for c in await js.consumers_info(names.EVENTS_STREAM)]
    assert not any(n.startswith("follow-") for n in left), left


PROBE = "refusal-probe"
"""The name of this test's own connections, which the servers log with each refusal."""


async def test_what_the_readme_says_is_refused_is_refused(stack: Stack) -> None:
    """Each refusal is the server's: a permissions violation, and no reply at all."""
    user, password = submitter_credentials(stack)
    violations: list[str] = []
    # The servers log every refusal below; they are this test's own (and only its own).
    stack.audit.allow_server(f":{PROBE}\" - ", "the test asks for what a submitter may not")

    async def on_error(exc: Exception) -> None:
        violations.append(str(exc))

    body = json.dumps(spec(f"refused-{uuid.uuid4().hex}")).encode()
    nc = await nats.connect(
        stack.nats.url,
        user=user,
        password=password,
        inbox_prefix=f"_INBOX_{user}",
        error_cb=on_error,
        name=PROBE,
    )
    try:
        js = nc.jetstream(timeout=2)
        mine = f"baton.events.{user}.r{'0' * 20}.*"
        refused = {
            # The submit subject without the user.
            "baton.submit.default": js.publish("baton.submit.default", body),
            # A durable consumer, an unnamed one (nats-py's ordered consumers), and a named
            # one on another owner's runs.
            "$js.api.consumer.durable.create.baton_events.mine": js.add_consumer(
                names.EVENTS_STREAM, durable_name="mine", filter_subject=mine
            ),
            "$js.api.consumer.create.baton_events": js.add_consumer(
                names.EVENTS_STREAM, filter_subject=mine
            ),
            "$js.api.consumer.create.baton_events.theirs.baton.events.alice.>": (
                js.add_consumer(names.EVENTS_STREAM, name="theirs", filter_subject=OTHERS)
            ),
        }
        outcomes = await asyncio.gather(*refused.values(), return_exceptions=True)
    finally:
        await nc.close()
    for subject, outcome in zip(refused, outcomes, strict=True):
        assert isinstance(outcome, nats.errors.TimeoutError), (subject, outcome)
        wanted = f'nats: permissions violation for publish to "{subject}"'
        assert wanted in violations, (wanted, violations)

    # A client's default inbox prefix: its replies' subscription is refused.
    violations.clear()
    nc = await nats.connect(
        stack.nats.url, user=user, password=password, error_cb=on_error, name=PROBE
    )
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("$JS.API.INFO", b"", timeout=2)
    finally:
        await nc.close()
    assert any(
        v.startswith('nats: permissions violation for subscription to "_inbox.') for v in violations
    ), violations

    op = await stack.client()
    submitted = await op.jetstream().stream_info(names.SUBMIT_STREAM)
    assert submitted.state.last_seq == 0, submitted.state
    consumers = [c.name for c in await op.jetstream().consumers_info(names.EVENTS_STREAM)]
    assert consumers == [], consumers
