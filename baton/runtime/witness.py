"""A run that checks itself: is this resume exact?

In deterministic mode a resumed attempt must compute, step for step, what the attempt
before it computed after the same checkpoint. So after each checkpoint the metrics reported
in the next `STEPS` steps are kept as the checkpoint's *witness* (write-once in the store,
beside the checkpoint: `shared.checkpoint.commit.witness_key`), and an attempt that resumes from a
checkpoint with a witness compares its own first steps with it, bit for bit. The first
difference is reported once (`Divergence`): a user learns that something the checkpoint does
not hold (an unregistered generator, a non-deterministic kernel, a plain iterator over a
DataLoader) changes the run, on the first resume rather than weeks later.

Only metrics reported during the step count (not values left over from an earlier step), so
an attempt that starts at the checkpoint sees what the first one saw. Whoever passes the
window first writes the witness; a resumed attempt that finds none writes its own, for the
next one to check against. A witness is small and best-effort: losing one loses a check,
never a run.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

from shared.errors import IntegrityError

STEPS = 3
"""Steps after a checkpoint whose metrics are its witness. One catches most breaks (the
first batch or dropout mask differs at once); a few more catch what drifts in the state of
an optimizer or scheduler a step later, at no cost worth naming."""

Row = dict[str, float]


@dataclass(frozen=True)
class Divergence:
    checkpoint: int
    step: int
    metric: str
    expected: float
    got: float


def same(a: float, b: float) -> bool:
    """Bit-for-bit equality (so NaN equals the same NaN, and 0.0 differs from -0.0)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def encode(rows: list[Row]) -> bytes:
    # float.hex() is exact for every double, NaN and the infinities included.
    return json.dumps([{k: v.hex() for k, v in row.items()} for row in rows]).encode()


def decode(data: bytes, checkpoint: int) -> list[Row]:
    try:
        rows = json.loads(data)
        out = [{str(k): float.fromhex(v) for k, v in row.items()} for row in rows]
    except (ValueError, TypeError, AttributeError) as exc:
        raise IntegrityError(
            f"the witness of checkpoint {checkpoint} is malformed: {exc}"
        ) from None
    if len(out) > STEPS:
        raise IntegrityError(f"the witness of checkpoint {checkpoint} has {len(out)} steps")
    return out


@dataclass
class Witness:
    """Per attempt: the windows being recorded, and the one being compared against."""

    enabled: bool
    recording: dict[int, list[Row]] = field(default_factory=dict)
    """Open windows, by the step of the checkpoint they follow."""
    expected: tuple[int, list[Row]] | None = None
    reported: bool = False

    def resumed(self, checkpoint: int, rows: list[Row] | None) -> None:
        """The attempt starts at `checkpoint`; `rows` is its witness, if it has one."""
        if not self.enabled or checkpoint == 0:
            return
        if rows:
            self.expected = (checkpoint, rows)
        else:
            self.recording[checkpoint] = []

    def checkpointed(self, step: int) -> None:
        if self.enabled and step > 0:
            self.recording[step] = []

    def stepped(
        self, step: int, metrics: Row
    ) -> tuple[list[tuple[int, list[Row]]], Divergence | None]:
        """After step `step` (1-based: steps done) reported `metrics`: the windows now complete
        (to be written), and a divergence if this step is the first to differ."""
        if not self.enabled:
            return [], None
        done = []
        for start, rows in list(self.recording.items()):
            rows.append(dict(metrics))
            if len(rows) == STEPS:
                done.append((start, self.recording.pop(start)))
        return done, self._compare(step, metrics)

    def _compare(self, step: int, metrics: Row) -> Divergence | None:
        if self.expected is None or self.reported:
            return None
        start, rows = self.expected
        index = step - start - 1
        if not 0 <= index < len(rows):
            return None
        want = rows[index]
        for name in sorted(want.keys() | metrics.keys()):
            a, b = want.get(name, math.nan), metrics.get(name, math.nan)
            if not same(a, b):
                self.reported = True
                return Divergence(checkpoint=start, step=step, metric=name, expected=a, got=b)
        return None
