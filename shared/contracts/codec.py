"""The one place where bytes become contract objects.

Every decoder in Baton goes through `decode`, so that every malformed message anywhere is
reported the same way: a `ContractError` whose `path` names the field (`$.total_steps`) and
whose `reason` says what is wrong with it, in words a user can act on.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Any, TypeVar, overload

import msgspec

from shared.errors import ContractError

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_PATH = re.compile(r"^(?P<reason>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


@overload
def decode(data: bytes | str, kind: type[T], *, max_bytes: int | None = None) -> T: ...
@overload
def decode(data: bytes | str, kind: UnionType, *, max_bytes: int | None = None) -> Any: ...
def decode(data: bytes | str, kind: Any, *, max_bytes: int | None = None) -> Any:
    """Decode `data` strictly as `kind` (a type, or a union of tagged structs such as
    `Event`), or raise `ContractError` naming the field."""
    if max_bytes is not None and len(data) > max_bytes:
        raise ContractError(f"payload is {len(data)} bytes, over the limit of {max_bytes} bytes")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _contract_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ContractError(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise ContractError("payload is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ContractError(f"payload is not valid UTF-8 (byte {exc.start})") from None


def convert(obj: Any, kind: type[T]) -> T:
    """Like `decode`, for an already-parsed object (a TOML table, a dict built in code)."""
    try:
        return msgspec.convert(obj, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise _contract_error(str(exc)) from None


def _contract_error(message: str) -> ContractError:
    match = _PATH.match(message)
    assert match is not None  # the pattern matches every string
    reason = match.group("reason")
    if reason.startswith("Object contains unknown field"):
        reason = "unknown field " + reason.removeprefix("Object contains unknown field ")
    return ContractError(reason, match.group("path") or "$")
