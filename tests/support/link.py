"""A WAN link for tests: a `Proxy` that also delays, jitters, caps bandwidth and flaps.

What a `Link` guarantees, per connection and direction:

* **Order.** Bytes arrive whole and in the order they were sent: each piece is released at
  `max(previous release, time off the wire + delay ± jitter)`, so jitter stretches gaps but
  never reorders (TCP would not hand a peer reordered bytes either).
* **Delay.** No piece arrives sooner than `delay_s - jitter_s` after it was read, so a
  round trip takes at least twice that.
* **Bandwidth.** A direction with a `Wire` delivers at most `rate × t` bytes in any `t`
  seconds (plus one piece), summed over every connection and link sharing that `Wire`: a
  FIFO queue drained at `rate`, holding at most `queue_s` worth of bytes. A sender waits for
  room, as TCP backs off when a router's queue is full, so a bulk upload sharing a `Wire`
  with control traffic delays it by up to `queue_s` (bufferbloat), as on a real uplink.

`Flapper` severs a link and restores it on a seeded random schedule (`Proxy.sever`: every
connection reset, dials refused until restored); `Proxy.accepted` counts the connections
piped through, so a test can report and bound reconnects.

Why a userspace proxy and not network namespaces with `tc`: this kernel has no `netem`, so
the kernel cannot delay or jitter at all; `tbf`/`htb` shape bandwidth but need root, a
namespace and veth pair per link, and every Baton process started inside the right
namespace. The proxy needs no privileges, applies to exactly one link (the leaf's, or a
site's way to the object store) while everything else stays on plain loopback, can delay,
cap and flap in one place, and counts connections. What it does not model: packet loss and
TCP's own congestion control (the sender sees back-pressure, never a drop), and a cap is
held to within one piece per `Wire` rather than by the kernel's packet scheduler. `tbf` is
the kernel's real shaper; where a test must prove something about the kernel's queueing
rather than Baton's behaviour over a slow, late, flapping link, use it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from types import TracebackType

from tests.support.proxy import Proxy

MBIT = 125_000.0
"""Bytes per second in one Mbit/s."""

_CHUNK = 65536
_WINDOW = 4 * 1024 * 1024
"""Bytes one direction of a connection may hold read but not yet delivered (on the wire)."""


class Wire:
    """One direction of a bottleneck: a FIFO queue drained at `rate` bytes/s, shared by every
    connection given it. `sent` counts the bytes it carried."""

    def __init__(self, rate: float, queue_s: float = 0.5) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, not {rate}")
        self.rate = rate
        self.queue_s = queue_s
        # Small pieces, so that a short message queues behind little more than what was
        # already waiting (about 10 ms of the rate, within 1–16 KiB).
        self.quantum = int(max(1024, min(16384, rate * 0.01)))
        self.sent = 0
        self._free_at = 0.0
        self._lock = asyncio.Lock()

    async def reserve(self, n: int) -> float:
        """Queue `n` bytes (at most `quantum`); returns the loop time at which they are off
        the wire. Waits, first come first served, while the queue holds `queue_s` or more."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            # Nobody else queues while we hold the lock: one wait makes the room.
            if (wait := self._free_at - loop.time() - self.queue_s) > 0:
                await asyncio.sleep(wait)
            self._free_at = max(loop.time(), self._free_at) + n / self.rate
            self.sent += n
            return self._free_at


class _Window:
    """Bytes in flight in one direction of one connection, bounded by `_WINDOW`."""

    def __init__(self) -> None:
        self.held = 0
        self.closed = False
        self._freed = asyncio.Event()

    async def take(self, n: int) -> None:
        while self.held > 0 and self.held + n > _WINDOW and not self.closed:
            self._freed.clear()
            await self._freed.wait()
        if self.closed:
            raise ConnectionResetError("the receiving end is gone")
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n
        self._freed.set()

    def close(self) -> None:
        self.closed = True
        self._freed.set()


class Link(Proxy):
    """A `Proxy` whose bytes cross a shaped link: `delay_s ± jitter_s` each way (uniform,
    seeded), and a bandwidth cap per direction — `rate` bytes/s each way on a `Wire` of its
    own, or `up`/`down` Wires shared with other links (one site's uplink). `up` is towards
    the target. `shape()` changes all of it at run time, for connections already open too."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        rate: float | None = None,
        up: Wire | None = None,
        down: Wire | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(target_host, target_port)
        self._rng = random.Random(seed)
        self.delivered = {True: 0, False: 0}
        """Bytes delivered, by direction (True: towards the target)."""
        self._trip: int | None = None
        self.delay_s = self.jitter_s = 0.0
        self.up: Wire | None = None
        self.down: Wire | None = None
        self.shape(delay_s=delay_s, jitter_s=jitter_s, rate=rate, up=up, down=down)

    @property
    def endpoint(self) -> str:
        """The link as an HTTP endpoint (an S3 server behind it)."""
        return f"http://127.0.0.1:{self.port}"

    def shape(
        self,
        *,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        rate: float | None = None,
        up: Wire | None = None,
        down: Wire | None = None,
    ) -> None:
        """From now on: this delay, jitter and cap (no arguments: a clean link)."""
        if not 0 <= jitter_s <= delay_s:
            raise ValueError(f"jitter {jitter_s} must be within 0 and the delay {delay_s}")
        self.delay_s, self.jitter_s = delay_s, jitter_s
        self.up = up or (Wire(rate) if rate else None)
        self.down = down or (Wire(rate) if rate else None)

    def sever_after(self, n: int) -> None:
        """Sever the link once `n` more bytes have been delivered towards the target: a cut
        placed mid-upload by bytes rather than by the clock."""
        self._trip = self.delivered[True] + n

    def _one_way(self) -> float:
        if not self.jitter_s:
            return self.delay_s
        return self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        window = _Window()
        carrier = asyncio.create_task(self._carry(queue, dst, window, up))
        released = 0.0
        clean = False
        try:
            while data := await src.read(_CHUNK):
                if self._mode == "blackholed":
                    continue
                wire = self.up if up else self.down
                step = wire.quantum if wire is not None else len(data)
                for i in range(0, len(data), step):
                    piece = data[i : i + step]
                    await window.take(len(piece))
                    off = await wire.reserve(len(piece)) if wire is not None else loop.time()
                    released = max(released, off + self._one_way())
                    queue.put_nowait((released, piece))
            clean = True
        except Exception:
            pass  # reset by a peer or by sever(): nothing more to deliver
        finally:
            queue.put_nowait(None)
            if not clean:  # cancelled too
                carrier.cancel()
                dst.transport.abort()
        if clean:
            # The sender closed: what is on the wire still arrives, then the close does.
            with contextlib.suppress(Exception):
                await carrier
            dst.close()

    async def _carry(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        dst: asyncio.StreamWriter,
        window: _Window,
        up: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while (item := await queue.get()) is not None:
                release, piece = item
                if (wait := release - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if dst.is_closing():
                    return  # severed while on the wire
                dst.write(piece)
                self.delivered[up] += len(piece)
                window.give(len(piece))
                if up and self._trip is not None and self.delivered[True] >= self._trip:
                    self._trip = None
                    self.sever()
                    return
                await dst.drain()
        finally:
            window.close()  # a sender waiting for room learns the far end is gone


class Flapper:
    """Severs `link` and restores it on a seeded random schedule until stopped, which
    leaves it restored: up for a uniform draw from `up_s` seconds, then down for one from
    `down_s`. The schedule is the fault being injected: it is the one thing here that waits
    on the clock.

    `after_restore(n)`, for the n-th restore (from 1), runs alongside the next up period,
    and the link is not severed again before it returns: a test checks what must hold
    after every flap (an outbox drained) without the next flap cutting the check short. It
    must bound itself (`eventually`); an exception from it stops the flapping and is raised
    by `stop()`."""

    def __init__(
        self,
        link: Proxy,
        *,
        up_s: tuple[float, float] = (5.0, 30.0),
        down_s: tuple[float, float] = (1.0, 4.0),
        seed: int = 0,
        after_restore: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.link = link
        self.up_s, self.down_s = up_s, down_s
        self.after_restore = after_restore
        self.cuts: list[tuple[float, float]] = []
        """(severed, restored) monotonic times of every flap so far; a flap still down when
        stopped is closed at the stop."""
        self._rng = random.Random(seed)
        self._task: asyncio.Task[None] | None = None
        self.started = 0.0

    @property
    def flaps(self) -> int:
        return len(self.cuts)

    def start(self) -> None:
        self.started = time.monotonic()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop flapping, restore the link, and raise what `after_restore` raised, if any."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        finally:
            self.link.restore()
            if self.cuts and self.cuts[-1][1] == 0.0:
                self.cuts[-1] = (self.cuts[-1][0], time.monotonic())

    async def __aenter__(self) -> Flapper:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _run(self) -> None:
        check: Awaitable[None] | None = None
        while True:
            up = asyncio.sleep(self._rng.uniform(*self.up_s))
            await (asyncio.gather(up, check) if check is not None else up)
            self.link.sever()
            self.cuts.append((time.monotonic(), 0.0))
            await asyncio.sleep(self._rng.uniform(*self.down_s))
            self.link.restore()
            self.cuts[-1] = (self.cuts[-1][0], time.monotonic())
            check = self.after_restore(len(self.cuts)) if self.after_restore else None
