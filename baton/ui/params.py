"""What the dashboard takes from a URL. Invariant: a value that reaches NATS or the store is
one the contracts allow — a run id matching `RUN_ID` (so never a subject wildcard such as
`*` or `>`, which would read every run's subjects), an integer within its range — and
anything else is answered 400 with a JSON error before anything is read."""

from __future__ import annotations

import math
import re

from starlette.datastructures import QueryParams

from baton.cli.errors import CliError
from shared.contracts import RunState
from shared.contracts.jobs import RUN_ID

BAD_REQUEST = 2
"""`CliError`'s code for a request to refuse (the server answers it 400)."""
MAX_SEQ = 2**63 - 1
"""A stream sequence or a step: JetStream's are unsigned 64-bit, Baton's steps smaller."""
_RUN_ID = re.compile(RUN_ID)


def bad(message: str) -> CliError:
    return CliError(message, BAD_REQUEST)


def run_id(value: str) -> str:
    """`value` if it is a run id (`shared.contracts.jobs.RUN_ID`)."""
    if not _RUN_ID.fullmatch(value):
        raise bad(f"not a run id: {value[:100]!r}")
    return value


def integer(params: QueryParams, name: str, default: int, low: int, high: int) -> int:
    """The query parameter `name` as an integer within [low, high]; `default` if absent."""
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    if not _digits(raw) or not low <= int(raw) <= high:
        raise bad(f"{name} must be an integer from {low} to {high}, not {raw[:40]!r}")
    return int(raw)


def number(text: str, name: str, low: int = 1) -> int:
    """A sequence or a step from the path, an integer within [low, `MAX_SEQ`]."""
    if not _digits(text) or not low <= int(text) <= MAX_SEQ:
        raise bad(f"{name} must be an integer from {low} to {MAX_SEQ}, not {text[:40]!r}")
    return int(text)


def _digits(text: str) -> bool:
    """ASCII digits, few enough for `int` (which takes other scripts' digits too)."""
    return text.isascii() and text.isdigit() and len(text) <= 19


def cursor(value: str | None) -> tuple[float, str] | None:
    """A page's `next` (`<created_at>:<run id>`), as the runs index orders by."""
    if not value:
        return None
    at, sep, rid = value.partition(":")
    try:
        when = float(at)
    except ValueError:
        when = math.nan
    if not sep or not math.isfinite(when) or not _RUN_ID.fullmatch(rid):
        raise bad(f"not a page cursor: {value[:100]!r}")
    return when, rid


def state(value: str) -> str:
    """A state filter: empty (any) or a run state's name, in either case."""
    if value and value.upper() not in RunState.__members__:
        raise bad(f"no run state {value[:40]!r} (one of {', '.join(RunState.__members__)})")
    return value
