"""A run of several ranks: this training process's place in its torch.distributed group.

Rank 0's process serves the group's `TCPStore` on any free port and tells its trainer
(`Listening`); the trainer hands the port to the other ranks' trainers, whose processes
connect to it. Every key is under `baton/<epoch>/` (a `PrefixStore`), so a process of an
older epoch that is still about can never take part in a newer group. The default process
group is NCCL with CUDA and gloo without; a second, gloo group carries Baton's own control
traffic, so the once-per-step agreement is a small CPU tensor whatever the backend.

What the group is used for besides the user's collectives:

* the agreement at every step boundary (`agree`): one all-reduce (MAX) of a few flags, so
  every rank stops and checkpoints at the same step — a rank that checkpointed or stopped
  alone would leave the others waiting in a collective that never completes;
* the checkpoint's files (`publish_files`, `gather_files`): each rank's writer puts its
  `FileRef`s in the store, rank 0's writer collects them into the one `CheckpointReady`;
* the checkpoint to resume from (`share`, `shared`): rank 0 picks it, the others load the
  same one, even if a commit lands while they look.

The writer thread has a store connection of its own: a `TCPStore` client serialises its
operations on one socket, and the writer's waits (as long as a peer's upload takes) would
otherwise hold up the training thread's.

**How a broken group shows** (`is_broken`), measured with torch 2.13 (CPU), gloo on
loopback, two processes:

* a peer SIGKILLed (or `os._exit`) while the survivor is in, or enters, a gloo all-reduce —
  a plain one or DDP's in `backward()` — raises a plain `RuntimeError` (not a `DistError`)
  in the survivor 20-35 ms after the kill, its message naming gloo's transport:
  `[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:…` or
  `[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:…: Connection reset by peer`;
* a peer that lives but never joins the collective: the same kind of `RuntimeError` after
  the group's timeout, `[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
  5000ms for recv operation to complete`; a normal exit after that then aborts the process
  more often than not (SIGABRT, "terminate called without an active exception": 3 of 4
  tries), so a broken group's process leaves by `os._exit`;
* a peer that never arrives: `init_process_group` raises `DistStoreError` after the
  timeout; a store that is not there: `DistNetworkError` from the `TCPStore` client (after
  the timeout, retried with back-off: ~3x the timeout);
* the store's server (rank 0) gone while a client waits on it: `DistNetworkError` ("Failed
  to recv, got 0 bytes") at once.

So a failure is the group's when it is a `DistError` or a `RuntimeError` raised by gloo's
transport, anywhere in the exception's `__cause__`/`__context__` chain (user code may wrap
it). NCCL (CUDA) was not measured here: torch reports NCCL's errors as
`DistBackendError`, a `DistError`, and its watchdog may instead abort the process on a
timeout, which its trainer sees as a signal.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# Their home: `torch.distributed` re-exports them without declaring it, which mypy refuses.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from shared.contracts import FileRef, decode, encode
from shared.contracts.child import Rendezvous

log = logging.getLogger("baton.runtime.group")

_WAIT_SLICE = timedelta(seconds=30)
"""How long a wait on the store goes before it says what it is still waiting for."""

_GLOO_TRANSPORT = re.compile(r"gloo/transport/")
"""Where gloo's own errors come from when a peer is gone or too slow (see above)."""


def is_broken(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) is the group's failure rather than the user's."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, dist.DistError):
            return True
        if type(cur) is RuntimeError and _GLOO_TRANSPORT.search(str(cur)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class Group:
    def __init__(
        self,
        rdv: Rendezvous,
        store: Store,
        writer: Store,
        control: dist.ProcessGroup,
        keep: list[Store],
    ) -> None:
        self.rank = rdv.rank
        self.world_size = rdv.world_size
        self.local_rank = rdv.local_rank
        self.epoch = rdv.epoch
        self._store = store
        self._writer = writer
        self._control = control
        self._keep = keep  # the TCPStores the prefixed views sit on: alive as long as we are
        self._left = False

    # -- the training thread -------------------------------------------------------------

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each flag, true for every rank once any rank sets it (torch's error if a peer is
        gone: `is_broken`)."""
        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return [bool(v) for v in t.tolist()]

    def share(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def shared(self, key: str) -> str:
        """What rank 0 shared under `key`, once it has."""
        _wait(self._store, key, "rank 0's choice of checkpoint")
        return self._store.get(key).decode()

    def leave(self) -> None:
        """Tear the group down at the end of a successful attempt, once every rank is there:
        past its last collective and its last write (whose files rank 0's store holds), so
        that no rank's teardown fails a collective a peer is still in."""
        if self._left:
            return
        self._left = True
        self.agree([True])
        dist.destroy_process_group()

    # -- the writer thread ---------------------------------------------------------------

    def publish_files(self, step: int, files: list[FileRef]) -> None:
        self._writer.set(_files_key(step, self.rank), encode(files).decode())

    def gather_files(self, step: int) -> list[FileRef]:
        """Every other rank's files of the checkpoint at `step`, in rank order. Waits as
        long as they take: a peer's upload may wait out a store outage, and a peer that
        died breaks the training thread's next collective, which ends the process."""
        out: list[FileRef] = []
        for rank in range(1, self.world_size):
            key = _files_key(step, rank)
            _wait(self._writer, key, f"rank {rank}'s files of step {step}")
            out += decode(self._writer.get(key), list[FileRef])
            self._writer.delete_key(key)  # read once; the store lives as long as the group
        return out


def join(rdv: Rendezvous, listening: Callable[[int], None]) -> Group:
    """Set up this process's group: serve (rank 0, calling `listening(port)` once the store
    is up) or join the store, then the process groups. Raises torch's error on a timeout."""
    timeout = timedelta(seconds=rdv.timeout_s)
    if rdv.rank == 0:
        tcp = TCPStore(
            rdv.addr, 0, rdv.world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        listening(tcp.port)
    else:
        tcp = TCPStore(
            rdv.addr, rdv.port, rdv.world_size, is_master=False, wait_for_workers=False,
            timeout=timeout,
        )  # fmt: skip
    own = TCPStore(
        rdv.addr, tcp.port, None, is_master=False, wait_for_workers=False, timeout=timeout
    )
    prefix = f"baton/{rdv.epoch}/"
    store, writer = PrefixStore(prefix, tcp), PrefixStore(prefix, own)
    cuda = torch.cuda.is_available()
    if cuda:  # the device `RunContext.device` names: NCCL works on the current one
        torch.cuda.set_device(rdv.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        store=PrefixStore("pg/", store),
        rank=rdv.rank,
        world_size=rdv.world_size,
        timeout=timeout,
    )
    # The same timeout: without it `new_group` takes gloo's own default (30 minutes), and a
    # peer that stops while the others are in the per-step agreement would hold them there.
    control = dist.new_group(backend="gloo", timeout=timeout)
    return Group(rdv, store, writer, control, [tcp, own])


def _wait(store: Store, key: str, what: str) -> None:
    """Wait for `key` as long as it takes (torch's error if the store's host, rank 0, is
    gone: its connection closes at once). What is waited for may take longer than any
    collective should: rank 0 verifies a whole checkpoint before it shares its choice, a
    peer's upload may wait out a store outage."""
    while True:
        try:
            store.wait([key], _WAIT_SLICE)
            return
        except dist.DistStoreError:  # the slice is over, not the store
            log.warning("still waiting for %s", what)


def _files_key(step: int, rank: int) -> str:
    return f"files/{step}/{rank}"
