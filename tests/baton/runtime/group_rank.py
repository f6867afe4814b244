"""One rank of a two-rank `baton.runtime.group` on loopback, as its own process (started
by `test_group.py`):

    python -m tests.baton.runtime.group_rank <rank> <timeout_s>

Each rank prints `ready` once it has imported torch and then reads a line from stdin:
rank 0 a go-ahead, rank 1 rank 0's port. So the group's set-up, timed from rank 0's store,
never waits on an import. Rank 0 serves the store, prints its port, and waits in the
per-step agreement; it prints `broken: <error>` and exits 3 once that fails as a broken
group. Rank 1 joins, prints `joined` and then takes part in nothing (it reads stdin until
it is killed): a peer that lives but hangs.
"""

from __future__ import annotations

import os
import sys

from baton.runtime.group import is_broken, join
from shared.contracts.child import Rendezvous


def main(rank: int, timeout_s: float) -> int:
    print("ready", flush=True)
    line = sys.stdin.readline()
    port = int(line) if rank else 0
    rdv = Rendezvous(
        epoch=1, rank=rank, world_size=2, addr="127.0.0.1", port=port, timeout_s=timeout_s
    )
    group = join(rdv, lambda p: print(p, flush=True))
    if rank == 1:
        print("joined", flush=True)
        sys.stdin.read()
        return 0
    try:
        group.agree([True])
    except Exception as exc:  # what the trainer's child does with it: is_broken decides
        print(f"broken: {is_broken(exc)}: {exc}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    code = main(int(sys.argv[1]), float(sys.argv[2]))
    # As the training child leaves a group that failed (`services/trainer/child.py`): a
    # normal exit after a gloo timeout may abort in gloo's teardown ("terminate called
    # without an active exception", SIGABRT), which would hide the status.
    sys.stdout.flush()
    os._exit(code)
