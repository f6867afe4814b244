"""The upload cap: one process never sends checkpoint files faster than `BATON_UPLOAD_BPS`.

Invariant: over any interval of `t` seconds, the bytes every `PacedFile` of one process
hands out sum to at most `rate × t + burst` — a token bucket shared by the whole process
(`pace_for`), so two uploads at once (a checkpoint's files, two stores) split the cap
rather than doubling it. A site's WAN uplink also carries its NATS link; a checkpoint that
took all of it would queue the leaf's pings and the trainers' lease renewals behind
megabytes of tensor data.

The pacing sits where the HTTP client reads the request body: aiohttp reads a file-like
body in a worker thread, a chunk at a time, and writes each chunk before reading the next,
so a read that waits for its tokens holds the upload back without blocking the event loop:
no byte can leave before it was read.
"""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from types import TracebackType

_BURST_S = 0.1
"""The bucket holds at most this long a share of the rate (and at least 4 KiB)."""

_paces: dict[float, Pace] = {}
_paces_lock = threading.Lock()


class Pace:
    """A thread-safe token bucket of `rate` bytes/s, `burst` bytes deep, starting empty."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"an upload rate must be positive, not {rate}")
        self.rate = rate
        self.burst = max(4096, int(rate * _BURST_S))
        self._tokens = 0.0
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block the calling thread until `n` bytes (at most `burst`) may go. Takers queue
        by running into debt: each waits until its own debt is paid off."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate) - n
            self._at = now
            wait = -self._tokens / self.rate
        if wait > 0:
            time.sleep(wait)


def pace_for(rate: float) -> Pace | None:
    """This process's bucket for `rate` (None for 0: no cap)."""
    if rate <= 0:
        return None
    with _paces_lock:
        if rate not in _paces:
            _paces[rate] = Pace(rate)
        return _paces[rate]


class PacedFile(io.RawIOBase):
    """Bytes `offset` … `offset + length` of a file, read through `pace` (None: at full
    speed). Seekable within the range, so an HTTP client can learn its length and rewind it
    for a retry; it has no `fileno`, so no client mistakes the whole file's size for its own.
    `read_so_far` counts bytes handed out, for progress."""

    def __init__(self, path: Path, offset: int, length: int, pace: Pace | None) -> None:
        super().__init__()
        self._f = path.open("rb")
        self._offset = offset
        self._length = length
        self._pos = 0
        self._pace = pace
        self.read_so_far = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(0, base + pos), self._length)
        return self._pos

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        n = min(len(buffer), self._length - self._pos)
        if self._pace is not None:
            n = min(n, self._pace.burst)
        if n <= 0:
            return 0
        if self._pace is not None:
            self._pace.take(n)
        data = os.pread(self._f.fileno(), n, self._offset + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        self.read_so_far += len(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()

    def __enter__(self) -> PacedFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
