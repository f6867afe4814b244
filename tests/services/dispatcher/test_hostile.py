"""Hostile submissions against one real dispatcher on a real nats-server: each one is either
dead-lettered with a reason or, if it happens to be a valid job, accepted as a run; none is
lost, none leaves a run record behind when rejected, and the dispatcher still serves after.

Hypothesis and async fixtures do not mix (a `@given` test would start a nats-server per
example, or share one across examples behind hypothesis' back). So hypothesis only *draws*
the payloads: a sync `@given` collector records every example into a list, and the one async
test publishes the lot to one dispatcher and checks each outcome. The price is no shrinking
of a failing payload; the failure message names the payload instead, which is enough to
reproduce it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from services.dispatcher.service import Dispatcher
from shared import config
from shared.bus import names
from shared.bus.streams import MAX_MSG_BYTES
from shared.contracts import JobSpec, decode, run_id_for
from shared.contracts.jobs import MAX_SPEC_BYTES
from shared.contracts.letters import DeadLetter
from shared.errors import ContractError
from shared.state.runs import Runs

GOOD: dict[str, Any] = {"name": "t", "entry_point": "examples.regression:train", "total_steps": 3}
# Room left under the server's message size limit for the headers of a submission.
LARGEST = MAX_MSG_BYTES - 4096

ODD = [
    "\u202e",  # right-to-left override
    "\u200f",  # right-to-left mark
    "\x00",
    "\u0301\u0301\u0301",  # combining marks with nothing to combine with
    "\ufeff",  # a byte-order mark in the middle of text
    "\U0001f600",
    "e\u0301",
    "\uffff",
    "\u2028",
]
# Escapes a JSON parser may accept but that no UTF-8 string can hold.
SURROGATES = ["\\ud800", "\\udfff", "\\ude00\\ud83d", "\\ud83d", "x\\udc80y"]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "nan", "inf"]
FIELDS = ["name", "idempotency_key", "entry_point", "pool"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
odd_text = st.lists(
    st.sampled_from(ODD) | st.characters(codec="utf-8"), min_size=1, max_size=8
).map("".join)


def _with(raw_fields: dict[str, str]) -> bytes:
    """A spec whose listed fields are spliced in as raw JSON text (which json.dumps could
    not write: bare NaN, lone surrogate escapes)."""
    parts = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in GOOD.items() if k not in raw_fields]
    parts += [f"{json.dumps(k)}: {v}" for k, v in raw_fields.items()]
    return ("{" + ", ".join(parts) + "}").encode()


@st.composite
def nested(draw: st.DrawFn) -> bytes:
    depth = draw(st.sampled_from([64, 1000, 10_000, 200_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    depth = min(depth, (LARGEST - 200) // len(opener + closer))
    inner = opener * depth + "1" + closer * depth
    if draw(st.booleans()):
        return _with({"config": '{"deep": ' + inner + "}"})
    return inner.encode()


@st.composite
def huge(draw: st.DrawFn) -> bytes:
    size = draw(st.sampled_from([MAX_SPEC_BYTES - 300, MAX_SPEC_BYTES, 300_000, LARGEST]))
    size += draw(st.integers(-200, 0))
    char = draw(st.sampled_from(["x", *ODD]))
    where = draw(st.sampled_from(["name", "idempotency_key", "config value", "config key"]))
    text = char * max(1, size // len(json.dumps(char)))
    if where == "config value":
        payload = json.dumps({**GOOD, "config": {"blob": text}})
    elif where == "config key":
        payload = json.dumps({**GOOD, "config": {text: 1}})
    else:
        payload = json.dumps({**GOOD, where: text})
    return payload.encode()[:LARGEST]


@st.composite
def non_finite(draw: st.DrawFn) -> bytes:
    token = draw(st.sampled_from(NON_FINITE))
    field = draw(st.sampled_from(["total_steps", "seed", "limits", "checkpoint", "config"]))
    wrapped = {
        "limits": '{"max_cost": %s}',
        "checkpoint": '{"every_seconds": %s}',
        "config": '{"lr": %s}',
    }.get(field, "%s")
    return _with({field: wrapped % token})


@st.composite
def odd_unicode(draw: st.DrawFn) -> bytes:
    field = draw(st.sampled_from([*FIELDS, "config"]))
    if draw(st.booleans()):
        value = '"' + draw(st.sampled_from(SURROGATES)) + '"'
    else:
        value = json.dumps(draw(odd_text), ensure_ascii=draw(st.booleans()))
    if field == "config":
        return _with({"config": "{" + value + ": " + value + "}"})
    return _with({field: value})


@st.composite
def fields(draw: st.DrawFn) -> bytes:
    spec = dict(GOOD)
    spec.update(draw(st.dictionaries(st.sampled_from([*GOOD, *FIELDS, "config", "seed"]),
                                     json_values | odd_text, max_size=3)))  # fmt: skip
    return json.dumps(spec, allow_nan=True, ensure_ascii=draw(st.booleans())).encode()


payloads = (
    st.binary(max_size=300)
    | nested()
    | huge()
    | non_finite()
    | odd_unicode()
    | fields()
    | st.builds(lambda v: json.dumps(v, allow_nan=True).encode(), json_values)
)


# The edges, every run, whatever hypothesis draws around them.
EDGES = [
    _with({"idempotency_key": '"\\ud800"'}),
    _with({"name": '"\\udfff"', "idempotency_key": '"k\\ud83d"'}),
    json.dumps({**GOOD, "config": {"blob": "x" * (MAX_SPEC_BYTES - 200)}}).encode(),
    json.dumps({**GOOD, "config": {"blob": "x" * MAX_SPEC_BYTES}}).encode(),
    json.dumps({**GOOD, "config": {"blob": "x" * LARGEST}}).encode()[:LARGEST],
    b"[" * (LARGEST // 2) + b"]" * (LARGEST // 2),
    _with({"total_steps": "NaN", "seed": "Infinity"}),
    json.dumps({**GOOD, "name": "\u202e\u0301", "config": {"\x00": "\u200f"}}).encode(),
]


def hostile_payloads(count: int) -> list[bytes]:
    drawn: list[bytes] = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(payloads)
    def collect(payload: bytes) -> None:
        drawn.append(payload)

    collect()
    # Hypothesis repeats examples; a repeat tests nothing new.
    return list(dict.fromkeys(EDGES + drawn))


def accepted_key(payload: bytes, msg_id: str) -> str | None:
    """The idempotency key a valid job is filed under, or None when the contract refuses
    it: the oracle the dispatcher's decisions are held to."""
    try:
        spec = decode(payload, JobSpec, max_bytes=MAX_SPEC_BYTES)
    except ContractError:
        return None
    return spec.idempotency_key or msg_id if spec.pool == "default" else None


async def dead_letters(nc: Client) -> dict[str, DeadLetter]:
    js = nc.jetstream()
    state = (await js.stream_info(names.DLQ_STREAM)).state
    letters = {}
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        letter = decode((await js.get_msg(names.DLQ_STREAM, seq)).data, DeadLetter)
        letters[letter.headers["Nats-Msg-Id"]] = letter
    return letters


async def subjects_count(nc: Client, stream: str, subject: str) -> int:
    info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def answered(nc: Client, serving: asyncio.Task[None], within: float) -> None:
    """Until every submission has had its final answer. The submit stream is a work queue:
    a message leaves it only when acked or terminated, so an empty stream is that moment.
    Polls the stream's state, as there is nothing to subscribe to for it."""
    js = nc.jetstream()
    deadline = time.monotonic() + within
    while (await js.stream_info(names.SUBMIT_STREAM)).state.messages:
        if serving.done():
            raise AssertionError(f"the dispatcher stopped: {serving.exception()!r}")
        if time.monotonic() > deadline:
            info = await js.consumer_info(names.SUBMIT_STREAM, names.DISPATCHER_CONSUMER)
            raise AssertionError(f"submissions unanswered after {within} s: {info.num_pending}"
                                 f" pending, {info.num_ack_pending} redelivering")  # fmt: skip
        await asyncio.sleep(0.1)


async def test_hostile_submissions_are_dead_lettered_or_accepted_never_lost(nc: Client) -> None:
    sent: dict[str, bytes] = {}
    valid: dict[str, str] = {}  # msg id -> idempotency key of the run it must create
    for payload in hostile_payloads(200):
        msg_id = f"hostile-{len(sent)}"
        key = accepted_key(payload, msg_id)
        if key is not None and key in valid.values():
            continue  # one key for two specs is another rejection, tested in test_dispatcher
        sent[msg_id] = payload
        if key is not None:
            valid[msg_id] = key
    rejected = set(sent) - set(valid)
    assert len(rejected) > 100, f"only {len(rejected)} hostile payloads were drawn"

    js = nc.jetstream()
    stop = asyncio.Event()
    dispatcher = Dispatcher(nc, config.load({"NATS_URL": "unused"}))
    await dispatcher.start()
    serving = asyncio.create_task(dispatcher.serve(stop))
    try:
        for msg_id, payload in sent.items():
            await js.publish(
                names.submit_subject("default"), payload, headers={"Nats-Msg-Id": msg_id}
            )
        await answered(nc, serving, within=30)

        letters = await dead_letters(nc)
        records = {r.run_id for r in await (await Runs.open(js)).all()}
        for msg_id, payload in sent.items():
            shown = payload[:200]
            if msg_id in valid:
                assert msg_id not in letters, f"valid job rejected: {shown!r}: {letters[msg_id]}"
                assert run_id_for(valid[msg_id]) in records, f"valid job lost: {shown!r}"
            else:
                assert msg_id in letters, f"hostile submission lost (no dead letter): {shown!r}"
                letter = letters[msg_id]
                assert letter.reason.strip(), f"dead letter without a reason: {shown!r}"
                assert letter.source == "dispatcher", f"letter from {letter.source}: {shown!r}"
        assert set(letters) == rejected, f"letters for no submission: {set(letters) - rejected}"
        # One record per valid job: no rejection left a record behind.
        expected = {run_id_for(k) for k in valid.values()}
        assert records == expected, f"records of rejected submissions: {records - expected}"
        announced = await subjects_count(
            nc, names.EVENTS_STREAM, names.event_subject("*", "rejected")
        )
        assert announced == len(rejected), f"{announced} rejected events, {len(rejected)} sent"

        # It survived all of that and still dispatches a valid job.
        last = json.dumps({**GOOD, "idempotency_key": "good-after-hostile"}).encode()
        await js.publish(names.submit_subject("default"), last, headers={"Nats-Msg-Id": "last"})
        await answered(nc, serving, within=10)
        # Queued for the scheduler (no trainer is live here, so it is not admitted yet).
        found = await (await Runs.open(js)).get(run_id_for("good-after-hostile"))
        assert found is not None, "no run after hostiles"
        assert found[0].state.value == "QUEUED" and not found[0].admitted, found[0]
    finally:
        stop.set()
        await serving
