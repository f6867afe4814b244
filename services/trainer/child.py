"""The training child process: runs one attempt of one run's entry point.

Forked by the trainer's zygote (`zygote.py`: `python -m services.trainer.child --zygote FD`,
which has imported torch once), or started as `python -m services.trainer.child CTL_IN CTL_OUT`
when there is none. CTL_IN and CTL_OUT are pipe descriptors: the trainer's commands come in
on one, progress and finished checkpoints go out on the other. stdout and stderr stay the
user's, captured by the trainer as the run's log. Every training process has a parent-death
signal set, so it can never outlive a trainer (or zygote) that was SIGKILLed.

In a run of several ranks (`Launch.group`), the process joins its group
(`baton.runtime.group`) before the entry point runs — rank 0 reports its store's port
(`Listening`) first — and leaves it when the attempt succeeds. How it exits says whose
failure ended it:

* 0: done, or stopped as asked (after `Finished`);
* `EXIT_USER_ERROR` (1): the user's code raised (traceback printed), or returned early;
* `EXIT_BAD_LAUNCH` (2): the entry point cannot be loaded;
* `EXIT_GUARDED` (4): the divergence guard stopped it (`baton.runtime.guard`), after
  `Tripped`;
* `EXIT_GROUP_BROKEN` (3): the group broke under it — a peer was gone or too slow, so a
  collective (the user's, or Baton's agreement at a step boundary) or the group's set-up
  failed (traceback printed). A rank whose peer's code raised exits 3: the peer's own exit
  (1) names the user's failure, and the survivor's is not one.

A process of a group that fails leaves by `os._exit` once its output is flushed: measured
with torch 2.13, a normal exit after a gloo collective timed out aborts the process in
gloo's teardown more often than not (SIGABRT), which would turn the status into a signal.

A process that finished (`Finished` sent: its last checkpoint written, its group left)
leaves promptly (`leave_promptly`): the user's exit hooks run, then it ends without the
interpreter's module teardown, which takes a second or more with torch loaded. Its trainer
gives it `FINISH_GRACE_S` to be gone before stopping it, so a clean finish kills nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from baton.runtime.compat import Changed
from baton.runtime.context import RunContext
from baton.runtime.guard import GuardTripped
from shared.contracts import decode, encode
from shared.contracts.child import (
    EXIT_BAD_LAUNCH,
    EXIT_CHANGED,
    EXIT_GROUP_BROKEN,
    EXIT_GUARDED,
    EXIT_USER_ERROR,
    Control,
    Finished,
    FromChild,
    Launch,
    Listening,
)

if TYPE_CHECKING:  # imported by a run of several ranks only
    from baton.runtime.group import Group

EXIT_ORPHANED = 70


def main(argv: list[str]) -> int:
    # A stop reaches a training process from its trainer alone (checkpoint, then leave), and
    # a trainer gone kills it (its parent-death signal). A SIGTERM sent to the whole job —
    # Slurm ending an allocation, systemd stopping a unit's control group, a `kill 0` —
    # would otherwise kill it before its trainer could ask for the checkpoint that hands
    # the run over at its step. (The zygote ignores it too, so the children it forks do.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if argv[1] == "--zygote":
        from services.trainer.zygote import serve

        _warm_up()
        return serve(int(argv[2]), lambda ctl_in, ctl_out: leave_promptly(run(ctl_in, ctl_out)))
    _warm_up()
    leave_promptly(run(int(argv[1]), int(argv[2])))


def leave_promptly(code: int) -> NoReturn:
    """End this training process once its attempt is over, as a normal exit would but for
    the interpreter's module teardown: threads the user's code left running are not waited
    for, the user's `atexit` hooks run (a metrics logger's last flush), and the output is
    flushed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    if spec.tracking is not None:  # before the user's code: its tracker client reads these
        from baton.tracking.tracker import prepare

        prepare(spec.tracking, launch.task.run_id, launch.group.rank if launch.group else 0)
    launched_at = time.monotonic()  # from here on, the time is the entry point's
    try:
        entry = load_entry_point(spec.entry_point)
    except Exception as exc:
        print(f"baton: cannot load entry point {spec.entry_point!r}: {exc}", file=sys.stderr)
        return EXIT_BAD_LAUNCH

    group: Group | None = None
    if launch.group is not None:
        from baton.runtime.group import join

        try:
            group = join(launch.group, lambda port: send(Listening(port=port)))
        except Exception:
            _leave(EXIT_GROUP_BROKEN)
    spool = Path(os.environ.get("BATON_SPOOL", "./.baton/spool")) / launch.task.run_id
    ctx = RunContext(
        launch.task, launch.token, launch.store_url, spool, send, launched_at, group=group,
        skips=launch.skips, allow_changes=launch.allow_changes,
    )  # fmt: skip
    threading.Thread(target=_listen, args=(ctl_in, ctx), daemon=True).start()
    return _attempt(entry, ctx, group, send)


def _held_back(exc: Changed | GuardTripped, ctx: RunContext) -> int:
    """The exit status of an attempt the run's own checks stopped: its resume under other
    software (before any step: nothing of it was written), or its divergence guard (the
    checkpoints of the steps before it are good, and written before leaving)."""
    if isinstance(exc, Changed):
        print(f"baton: {exc}", file=sys.stderr)
        sys.stderr.flush()
        return EXIT_CHANGED
    print(f"baton: the divergence guard stopped the run at {exc}", file=sys.stderr)
    with contextlib.suppress(BaseException):
        ctx.close()
    return EXIT_GUARDED


def _attempt(
    entry: Callable[[RunContext], Any],
    ctx: RunContext,
    group: Group | None,
    send: Callable[[FromChild], None],
) -> int:
    try:
        entry(ctx)
        ctx.close()
    except (Changed, GuardTripped) as exc:
        code = _held_back(exc, ctx)
        if group is None:
            return code
        _leave(code, trace=False)
    except BaseException as exc:
        if group is None:
            traceback.print_exc()
            sys.stderr.flush()
            return EXIT_USER_ERROR
        from baton.runtime.group import is_broken

        _leave(EXIT_GROUP_BROKEN if is_broken(exc) else EXIT_USER_ERROR)
    if ctx.step < ctx.total_steps and not ctx.finished_early:
        print(
            f"baton: entry point returned at step {ctx.step} of {ctx.total_steps}",
            file=sys.stderr,
        )
        if group is not None:
            _leave(EXIT_USER_ERROR, trace=False)  # its peers wait in a collective for it
        return EXIT_USER_ERROR
    if group is not None:
        try:
            group.leave()
        except Exception:
            _leave(EXIT_GROUP_BROKEN)
    send(Finished(step=ctx.step, stopped=ctx.finished_early))
    return 0


def _leave(code: int, trace: bool = True) -> NoReturn:
    """Leave a group's process at once with `code`, the exception being handled printed
    first (see the module's docstring for why not by a normal exit)."""
    if trace:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
        ctx.request(msg.action, msg.token, msg.step)
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
