"""Every decoder refuses hostile input with a ContractError, never anything else; and no
code path deserialises with pickle."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.contracts import CommitRequest, JobSpec, Manifest, Pointer, RunRecord, Task, decode
from shared.contracts.child import Control, Launch
from shared.contracts.control import CancelRequest, Command, WorkerInfo
from shared.contracts.events import Event
from shared.errors import ContractError

REPO = Path(__file__).resolve().parents[2]
KINDS: list[Any] = [
    JobSpec, Task, RunRecord, CommitRequest, Manifest, Pointer, Launch, Control,
    CancelRequest, Command, WorkerInfo, Event,
]  # fmt: skip
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)


def must_refuse_or_accept(data: bytes, kind: Any) -> None:
    try:
        decode(data, kind, max_bytes=64 * 1024)
    except ContractError as exc:
        assert exc.reason  # a reason a person can read
        assert exc.path.startswith("$")


@FAST
@given(st.binary(max_size=2000))
def test_random_bytes(data: bytes) -> None:
    for kind in KINDS:
        must_refuse_or_accept(data, kind)


@FAST
@given(json_values)
def test_random_json(value: Any) -> None:
    data = json.dumps(value, allow_nan=True).encode()
    for kind in KINDS:
        must_refuse_or_accept(data, kind)


@FAST
@given(st.dictionaries(st.sampled_from(["name", "entry_point", "total_steps", "pool", "seed",
                                        "config", "checkpoint", "limits", "idempotency_key"]),
                       json_values, max_size=9))  # fmt: skip
def test_job_specs_with_any_field_values(fields: dict[str, Any]) -> None:
    must_refuse_or_accept(json.dumps(fields, allow_nan=True).encode(), JobSpec)


def test_nesting_huge_strings_non_finite_numbers_and_odd_unicode() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    base = {"name": "x", "entry_point": "m:f", "total_steps": 1}
    cases = [
        deep,
        json.dumps({**base, "config": {"a": "x" * 10_000_000}}).encode(),
        b'{"name": "x", "entry_point": "m:f", "total_steps": NaN}',
        b'{"name": "x", "entry_point": "m:f", "total_steps": 1e999}',
        json.dumps({**base, "name": "\u202e\u0000evil"}).encode(),
        json.dumps({**base, "entry_point": "os:system; rm -rf /"}).encode(),
        json.dumps({**base, "pool": "a.b.>"}).encode(),
        '{"name": "\ud800"}'.encode("utf-8", "surrogatepass"),
    ]
    for data in cases:
        for kind in KINDS:
            must_refuse_or_accept(data, kind)
    try:
        decode(json.dumps({**base, "name": "\u202e\u0000evil"}).encode(), JobSpec)
        raise AssertionError("a control character in a name was accepted")
    except ContractError as exc:
        assert exc.path == "$.name"


def test_no_pickle_anywhere() -> None:
    """No module deserialises with pickle, loads torch files without weights_only, or
    evaluates strings."""
    forbidden = [
        (re.compile(r"\bimport pickle\b|\bfrom pickle\b|\bcloudpickle\b|\bdill\b"), "pickle"),
        (
            re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"),
            "torch.load without weights_only=True",
        ),
        (re.compile(r"(?<![\w.])eval\(|(?<![\w.])exec\("), "eval/exec"),
    ]
    offenders = []
    for folder in ("baton", "services", "shared", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            for pattern, what in forbidden:
                if pattern.search(text):
                    offenders.append(f"{path.relative_to(REPO)}: {what}")
    assert not offenders, offenders
