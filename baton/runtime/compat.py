"""What a checkpoint records of the software that wrote it, and what a resume compares.

A run resumes exactly only under what it was checkpointed with: another torch may pick other
kernels, another Baton may draw its data or its RNG states otherwise, and changed entry-point
code is another training loop. So rank 0 records in every checkpoint's meta.json the torch,
Python and Baton versions and a digest of the entry point's module file, and every resume
compares them with its own (`RunContext.restore`):

* nothing changed: nothing said;
* something changed, in a run that is not `deterministic`, or one whose operator allowed it
  (`baton resume RUN --allow-changes`): the resume goes on, and says what changed — a
  `warning` event (kind `changed_since_checkpoint`) and `baton status`;
* something changed in a `deterministic` run, not allowed: the attempt is refused before the
  loop trains a step (`Changed`), and the run is PAUSED for its operator, saying what changed.

A checkpoint written before this was recorded (no `versions`, or no `baton` or `code` in it)
is compared on what it has.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import torch

from baton.version import __version__

FIELDS = ("torch", "python", "baton", "code")


class Changed(RuntimeError):
    """The resume of a deterministic run would not be exact: what it was checkpointed with
    changed, and its operator has not allowed that."""


def recorded(entry_point: str) -> dict[str, str]:
    """What this process runs under, as a checkpoint records it."""
    return {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "baton": __version__,
        "code": code_digest(entry_point),
    }


@cache
def code_digest(entry_point: str) -> str:
    """sha256 (16 hex digits) of the file that defines `module:function`; "" when it has no
    file to read (a module built in, or one that cannot be found)."""
    module = entry_point.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    origin = found.origin if found is not None else None
    if not origin or not Path(origin).is_file():
        return ""
    return hashlib.sha256(Path(origin).read_bytes()).hexdigest()[:16]


def changes(saved: Mapping[str, object], now: Mapping[str, str]) -> list[str]:
    """Each field that differs between what a checkpoint recorded and `now`, in words; a
    field the checkpoint did not record is not compared."""
    out = []
    for field in FIELDS:
        before = saved.get(field)
        if not isinstance(before, str) or not before or before == now.get(field):
            continue
        if field == "code":
            out.append(f"the entry point's code ({before} -> {now.get(field) or 'unreadable'})")
        else:
            out.append(f"{field} {before} -> {now.get(field)}")
    return out
