"""What the dashboard takes from a URL or an action's body. Invariant: a value that reaches
NATS or the store is one the contracts allow — a run id matching `RUN_ID` (so never a
subject wildcard such as `*` or `>`, which would read every run's subjects), a pool name
matching `TOKEN`, a worker id
that can be a KV key, an integer within its range, an action's body of the one shape
`ActionBody` — and anything else is answered 400 with a JSON error before anything is read
or written."""

from __future__ import annotations

import math
import re
from typing import Annotated

import msgspec
from msgspec import Meta
from starlette.datastructures import QueryParams
from starlette.requests import Request

from baton.client.errors import CliError
from shared.contracts import RunState
from shared.contracts.jobs import RUN_ID, TOKEN
from shared.errors import ContractError
from shared.state.drains import check_worker

BAD_REQUEST = 2
"""`CliError`'s code for a request to refuse (the server answers it 400)."""
MAX_SEQ = 2**63 - 1
"""A stream sequence or a step: JetStream's are unsigned 64-bit, Baton's steps smaller."""
LETTERS_PAGE = 25
"""Dead letters on a page unless the page asks for another number (`limit`)."""
MAX_LETTERS_PAGE = 100
_RUN_ID = re.compile(RUN_ID)
_TOKEN = re.compile(TOKEN)


def bad(message: str) -> CliError:
    return CliError(message, BAD_REQUEST)


def run_id(value: str) -> str:
    """`value` if it is a run id (`shared.contracts.jobs.RUN_ID`)."""
    if not _RUN_ID.fullmatch(value):
        raise bad(f"not a run id: {value[:100]!r}")
    return value


def pool(value: str) -> str:
    """`value` if it can name a pool (`shared.contracts.jobs.TOKEN`: a subject token, so
    never a wildcard)."""
    if not _TOKEN.fullmatch(value):
        raise bad(f"not a pool name: {value[:100]!r}")
    return value


def integer(params: QueryParams, name: str, default: int, low: int, high: int) -> int:
    """The query parameter `name` as an integer within [low, high]; `default` if absent."""
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    if not _digits(raw) or not low <= int(raw) <= high:
        raise bad(f"{name} must be an integer from {low} to {high}, not {raw[:40]!r}")
    return int(raw)


def letters_page(params: QueryParams) -> tuple[int, int]:
    """A page of dead letters: (`after`, `limit`) — the sequence its letters come after (a
    previous page's `next`; 0, the default, from the first) and how many it holds at most
    (`LETTERS_PAGE` unless given, at most `MAX_LETTERS_PAGE`)."""
    after = integer(params, "after", 0, 0, MAX_SEQ)
    return after, integer(params, "limit", LETTERS_PAGE, 1, MAX_LETTERS_PAGE)


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


def worker(value: str) -> str:
    """`value` if it can name a trainer (`shared.state.drains.check_worker`: a KV key, so
    never a wildcard)."""
    try:
        return check_worker(value)
    except ContractError:
        raise bad(f"not a worker id: {value[:100]!r}") from None


MAX_BODY = 16 * 1024
"""An action's body, at most: a reason and a fork's overrides."""


class ActionBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What an action's POST may carry (JSON; none at all is all defaults): the `reason`
    recorded with it, and a fork's `overrides`, each `path=value` as `baton fork --set`
    takes them (`baton.client.rebase.parse_set`)."""

    reason: Annotated[str, Meta(max_length=512)] = ""
    overrides: Annotated[list[Annotated[str, Meta(max_length=1000)]], Meta(max_length=64)] = []


async def action_body(request: Request) -> ActionBody:
    """The request's body as an `ActionBody`; 400 naming what is wrong with it."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise bad(f"an action's body is at most {MAX_BODY} bytes")
    if not raw.strip():
        return ActionBody()
    try:
        return msgspec.json.decode(raw, type=ActionBody)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise bad(f"not an action's body: {exc}") from None
