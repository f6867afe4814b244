"""Telling a hardware fault from the run's own code failing, by how its process ended.

Invariant: an attempt whose training process died of a fault of the machine's hardware is
marked so (`AttemptFailed.fault`: `hardware`) and never charged
(`shared.ledger.charges`); it is still counted against the run's retries, as any failed
attempt (a fault that comes back on every attempt fails the run, as its policy says).
Only what says "hardware" beyond doubt counts: a SIGBUS (a memory page the machine could
not read back: an uncorrectable memory error), or the CUDA runtime's own words for a GPU
whose memory or link failed — an uncorrectable ECC error, a GPU fallen off the bus. A
user's illegal memory access, an out-of-memory or a NaN is the run's own.
"""

from __future__ import annotations

import signal

HARDWARE = "hardware"
MACHINE = "machine"
SILENT = "its trainer went silent (its key was not renewed)"
"""Why a group broke when a member's trainer stopped renewing its key: its machine is lost
(`services.trainer.group`)."""

_SAID = (
    "uncorrectable ECC error encountered",
    "GPU has fallen off the bus",
)
"""What the CUDA runtime (and the driver, in the kernel's log it relays) says of a GPU's
hardware failing."""


def fault_of(code: int, tail: str) -> str:
    """`hardware` when a training process that exited with `code` (negative: killed by that
    signal), its output ending in `tail`, died of a hardware fault; "" otherwise."""
    if code == -signal.SIGBUS:
        return HARDWARE
    return HARDWARE if any(words in tail for words in _SAID) else ""
