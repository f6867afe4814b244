"""A trainer's work directory: held for its whole life, and what it holds written down.

A trainer's death is certain to the next process that starts under the same worker identity
in the same work directory. Each trainer holds an exclusive `flock` on `trainer.lock` there
for as long as it lives; the kernel drops the lock with the process however it ends (SIGKILL,
OOM, a crash), and not before. So a trainer that gets the lock knows its predecessor is gone —
not silent, not cut off: gone.

While an attempt runs, the trainer keeps a claim there (`claim.json`: the run, its lease key
and token), removed when the attempt is over. A successor that finds a claim hands the run
over at once (`Trainer.start`): it frees the lease if the lease still names this worker and
that token, and naks the attempt's task delivery (`shared.state.handover`), so JetStream
delivers the task again now instead of after its AckWait — and whichever trainer gets it
resumes from the run's last commit, seconds after the kill instead of a TTL.

Why the shortcut is safe: the holder is dead, so it renews nothing and commits nothing. Its
training process dies with it (a parent-death signal); and were one to survive, it would be a
zombie like any other — the next attempt takes a higher token, and the checkpointer refuses
every commit of a lower one. A freed lease that a live holder still used would lose the holder
nothing but its run (it is fenced at its next renewal), and only the lock's certainty lets a
trainer free one. A trainer that is merely silent — SIGSTOPped, or behind a cut link — keeps
the lock, so nothing is handed over before its lease runs out.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from shared.contracts import decode, encode
from shared.contracts.tasks import Claim
from shared.errors import ConfigError, ContractError

log = logging.getLogger("baton.trainer")

LOCK = "trainer.lock"
CLAIM = "claim.json"


class WorkDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Hold the directory for this process's life; refuse to share it with a live
        trainer (two trainers in one directory would read each other's claims)."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another live trainer holds the work directory {self.path}; "
                "give each trainer its own BATON_WORK_DIR"
            ) from None
        os.set_inheritable(fd, False)  # training processes must not keep it alive
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def hold(self, claim: Claim) -> None:
        """Write the claim before the attempt starts (atomically: a successor reads either
        the whole claim or none)."""
        tmp = self.path / f".{CLAIM}.tmp"
        tmp.write_bytes(encode(claim))
        os.replace(tmp, self.path / CLAIM)

    def let_go(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / CLAIM).unlink()

    def left_behind(self) -> Claim | None:
        """The claim of a predecessor that died during an attempt; only meaningful once
        `lock()` has succeeded."""
        try:
            data = (self.path / CLAIM).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return decode(data, Claim)
        except ContractError as exc:
            log.warning("ignored an unreadable claim in %s: %s", self.path, exc)
            self.let_go()
            return None
