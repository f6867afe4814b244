"""The training child process: runs one attempt of one run's entry point.

Forked by the trainer's zygote (`zygote.py`: `python -m services.trainer.child --zygote FD`,
which has imported torch once), or started as `python -m services.trainer.child CTL_IN CTL_OUT`
when there is none. CTL_IN and CTL_OUT are pipe descriptors: the trainer's commands come in
on one, progress and finished checkpoints go out on the other. stdout and stderr stay the
user's, captured by the trainer as the run's log. Every training process has a parent-death
signal set, so it can never outlive a trainer (or zygote) that was SIGKILLed.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton.runtime.context import RunContext
from shared.contracts import decode, encode
from shared.contracts.child import EXIT_BAD_LAUNCH, Control, Finished, FromChild, Launch

EXIT_USER_ERROR = 1
EXIT_ORPHANED = 70


def main(argv: list[str]) -> int:
    if argv[1] == "--zygote":
        from services.trainer.zygote import serve

        _warm_up()
        return serve(int(argv[2]), run)
    _warm_up()
    return run(int(argv[1]), int(argv[2]))


def run(ctl_in_fd: int, ctl_out_fd: int) -> int:
    """One attempt: wait for the `Launch`, run the entry point, report how it ended."""
    ctl_in = os.fdopen(ctl_in_fd, "rb", buffering=0)
    ctl_out = os.fdopen(ctl_out_fd, "wb", buffering=0)
    out_lock = threading.Lock()

    def send(msg: FromChild) -> None:
        line = encode(msg) + b"\n"
        with out_lock:
            ctl_out.write(line)

    launch = decode(ctl_in.readline(), Launch)
    spec = launch.task.spec
    _configure_torch(spec.deterministic, spec.seed)
    launched_at = time.monotonic()  # from here on, the time is the entry point's
    try:
        entry = load_entry_point(spec.entry_point)
    except Exception as exc:
        print(f"baton: cannot load entry point {spec.entry_point!r}: {exc}", file=sys.stderr)
        return EXIT_BAD_LAUNCH

    spool = Path(os.environ.get("BATON_SPOOL", "./.baton/spool")) / launch.task.run_id
    ctx = RunContext(launch.task, launch.token, launch.store_url, spool, send, launched_at)
    threading.Thread(target=_listen, args=(ctl_in, ctx), daemon=True).start()
    try:
        entry(ctx)
        ctx.close()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return EXIT_USER_ERROR
    if ctx.step < ctx.total_steps and not ctx.finished_early:
        print(
            f"baton: entry point returned at step {ctx.step} of {ctx.total_steps}",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    send(Finished(step=ctx.step, stopped=ctx.finished_early))
    return 0


def load_entry_point(spec: str) -> Callable[[RunContext], Any]:
    module_name, _, func_name = spec.partition(":")
    extra = [p for p in os.environ.get("BATON_ENTRY_PATH", "").split(os.pathsep) if p]
    for path in [os.getcwd(), *reversed(extra)]:
        if path not in sys.path:
            sys.path.insert(0, path)
    module = importlib.import_module(module_name)
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ImportError(f"{module_name} has no callable {func_name!r}")
    return fn  # type: ignore[no-any-return]


def _listen(ctl_in: Any, ctx: RunContext) -> None:
    for line in ctl_in:
        msg = decode(line, Control)
        ctx.request(msg.action, msg.token)
    # The trainer closed our pipe: it is gone, and nobody would commit what we produce.
    os._exit(EXIT_ORPHANED)


def _warm_up() -> None:
    """Pay torch's one-off costs before any run is handed over — once, in the trainer's
    zygote, whose forks inherit them: the first `use_deterministic_algorithms` call alone
    takes over a second (it imports more of torch), which a takeover would otherwise wait
    for."""
    import torch

    torch.use_deterministic_algorithms(False)


def _configure_torch(deterministic: bool, seed: int) -> None:
    import random

    import numpy as np
    import torch

    if deterministic:
        # Reductions split over threads may sum in a different order from run to run.
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
