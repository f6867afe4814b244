"""A training loop Baton does not own: a framework's (Hugging Face `Trainer`, Accelerate,
Lightning) or a user's own, whose checkpoints the framework writes itself.

`baton.integrations` builds on this; a loop written by hand uses it the same way:

    loop = ExternalLoop(ctx)                  # instead of ctx.restore() and ctx.steps()
    resume = loop.resume()                    # a directory, or None on a fresh run
    framework.load(resume) if resume else None
    for ...:                                  # the framework's own loop
        ...one optimizer step...
        at = loop.step_ended(step, loss=loss) # `step` counts the steps done
        if at.save:
            framework.save(directory)
            loop.saved(step, directory, weights=model.state_dict())
        if at.stop:
            break

**Saving.** The framework writes its checkpoint into a directory of plain files, as it
always does; `saved` links them aside at once (copies them across file systems), so the
framework may delete them later — but must write a later checkpoint as new files, not
rewrite these in place (each integration saves every step into a directory of its own).
The checkpoint's writer thread stores each file as `file.<name>` beside Baton's `meta.json`
and `rng.safetensors`, under the attempt's fencing token, and hands them to the trainer to
commit. So a framework's checkpoint is a fenced, verified commit like any other, and one of
a run of several ranks holds every rank's files (`rank<k>.file.<name>`). A save waits for
the one before it to be stored; the loop goes on while the store takes this one. The digest
a run ends with is of `weights`.

**When to save and stop.** `step_ended` is the step boundary every rank agrees on (one
all-reduce in a group): `save` is set when the job's checkpoint policy or the trainer asks
for a checkpoint, when the run is told to stop (preemption: `stop` too), and at the last
step (the final checkpoint a run completes with). A framework's own save cadence is
honoured as well: every `saved` is a commit.

**Resuming.** `resume` downloads the newest committed checkpoint's files — every rank's,
under their own names, this rank's own winning where two ranks wrote the same name — into a
fresh directory and returns it, for the framework to load; the global RNGs are put back as
they were at the save (a framework that restores its own does so later, and wins).

**The self-check.** The metrics of a step (`step_ended`'s, or reported later with
`reported`, as a framework's log callback does) make its row of the checkpoint's witness
(`baton.runtime.witness`); a resumed attempt compares its first steps with the rows an
earlier attempt left, and a difference is reported as `diverged`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.runtime.context import RunContext
from baton.runtime.load import download, set_rng_state
from baton.tracking.rows import SLOT as TRACKING_SLOT
from shared.checkpoint import files as checkpoint_files
from shared.checkpoint.files import MAX_NAME, META, SUFFIX, rank_prefix
from shared.contracts import Manifest, spec_hash
from shared.contracts.child import Loaded
from shared.errors import IntegrityError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A framework file's name Baton can store (`file.<name>`, `shared.checkpoint.files`)."""


def local_dir(ctx: RunContext, name: str) -> Path:
    """A directory of this rank's own on this host, for a framework's output (`name-rank<k>`
    in the run's spool): ranks of one group on one host never share one."""
    return ctx._spool / f"{name}-rank{ctx.rank}"


@dataclass(frozen=True)
class Boundary:
    """What the run wants once a step is done, the same on every rank."""

    save: bool
    """Save a checkpoint of this step now (and call `ExternalLoop.saved`)."""
    stop: bool
    """Stop training after that save: the run is being preempted, cancelled or drained."""


class ExternalLoop:
    def __init__(self, ctx: RunContext) -> None:
        if ctx._checkpoints.slots:
            raise RuntimeError("ctx.restore() was called: a run either owns its loop or not")
        if ctx.spec.elastic:
            raise ValueError(
                "a framework's checkpoint holds a state per rank at one group size, which an"
                " elastic run (ranks given as a range) cannot resume at another: give ranks"
                " as a number"
            )
        self.ctx = ctx
        self._row: tuple[int, dict[str, float], bool] | None = None
        """The last step's metrics, open until they are all in (the step, them, whether a
        checkpoint of it is due): its row of the witness, and its progress report."""
        self._resumed: Path | None = None
        self._started = False

    # -- resuming ------------------------------------------------------------------------

    def resume(self) -> Path | None:
        """Download the checkpoint to resume from; its directory, or None on a fresh run.
        `ctx.step` is then the step it holds."""
        ctx = self.ctx
        if self._started:
            return self._resumed
        self._started = True
        began = time.monotonic()
        manifest, damaged, rows, _ = asyncio.run(ctx._checkpoints.find(ctx._witness.enabled))
        if manifest is not None:
            self._resumed = self._download(manifest)
            ctx.step = manifest.step
            ctx._checkpoints.taken(ctx.step)
        ctx._witness.resumed(ctx.step, rows)
        if ctx.tracking is not None:  # rows under the framework's global step
            ctx.tracking.step_base = 1
            ctx.tracking.resumed(ctx.step, ctx.step)
        setup = max(0.0, began - ctx._launched_at)
        ctx._send(
            Loaded(step=ctx.step, damaged=damaged, took_s=time.monotonic() - began, setup_s=setup)
        )
        return self._resumed

    def _download(self, manifest: Manifest) -> Path:
        ctx, step = self.ctx, manifest.step
        own = rank_prefix(ctx.rank)
        mine = {own + META, f"{own}rng{SUFFIX}"}
        theirs = [f for f in manifest.files if checkpoint_files.foreign_name(f.name)]
        wanted = [f for f in manifest.files if f.name in mine]
        if len(wanted) != len(mine):
            raise IntegrityError(f"checkpoint {step} lacks this rank's {' and '.join(mine)}")
        into = ctx._spool / f"{own}resume"
        shutil.rmtree(into, ignore_errors=True)
        incoming = into / ".incoming"
        incoming.mkdir(parents=True)
        local = asyncio.run(
            download(
                ctx._checkpoints.store_url, wanted + theirs, incoming, check_hashes=ctx.rank > 0
            )
        )
        meta = checkpoint_files.read_meta(local[own + META])
        if meta.get("run_id") != ctx.run_id or meta.get("spec_hash") != spec_hash(ctx.spec):
            raise IntegrityError(f"checkpoint {step} belongs to another run or job spec")
        if ctx.tracking is not None and isinstance(rows := meta.get(TRACKING_SLOT), dict):
            ctx.tracking.rows.state.update(rows)  # not yet written when it was taken
        if "external" not in meta:
            raise IntegrityError(
                f"checkpoint {step} was written by ctx.restore()'s own loop, not a framework's:"
                " resume it with ctx.restore()"
            )
        rng = checkpoint_files.load_tensors(local[f"{own}rng{SUFFIX}"], f"{own}rng{SUFFIX}")
        try:
            set_rng_state(rng, meta["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"checkpoint {step}: malformed RNG state: {exc!r}") from None
        # Every rank's files under their own names; where two ranks wrote one name, ours.
        for ref in sorted(theirs, key=lambda f: checkpoint_files.rank_of(f.name) == ctx.rank):
            name = checkpoint_files.foreign_name(ref.name)
            assert name is not None
            os.replace(local[ref.name], into / name)
        shutil.rmtree(incoming)
        return into

    # -- at every step -------------------------------------------------------------------

    def step_ended(self, step: int, **metrics: float) -> Boundary:
        """`step` optimizer steps are done (the framework's global step), with `metrics`
        (more may come with `reported`). Every rank calls this at every step."""
        ctx = self.ctx
        if not self._started:
            raise RuntimeError("call resume() before the first step, even on a fresh run")
        if step != ctx.step + 1:
            raise ValueError(f"step_ended({step}) after step {ctx.step}: one call per step")
        self._close_row()
        ctx.step = step
        save = ctx._boundary(report=False)  # reported once the step's metrics are in
        final = step >= ctx.total_steps
        stop = ctx.should_stop and not final
        self._row = (step, {}, save or stop or final)
        self.reported(step, **metrics)
        return Boundary(save=save or stop or final, stop=stop)

    def reported(self, step: int, **metrics: float) -> None:
        """Metrics the framework logged for `step` (its loss, learning rate, …)."""
        values = {k: float(v) for k, v in metrics.items()}
        self.ctx.report(**values)
        self.ctx._step_metrics.clear()  # rows are kept here, by the step they belong to
        if self._row is not None and self._row[0] == step:
            self._row[1].update(values)

    def _close_row(self) -> None:
        """The last step's metrics are all in: its witness row, then its progress (the
        metrics a step's report carries are its own, not the step's before)."""
        if self._row is not None:
            step, row, due = self._row
            self._row = None
            self.ctx._guarded(self.ctx._guard.stepped(step, row))
            self.ctx._witnessed(step, row)
            if self.ctx.tracking is not None:  # under the framework's global step
                self.ctx.tracking.stepped(step, row)
                self.ctx.tracking.flush()
            self.ctx._progress(due)

    # -- saving --------------------------------------------------------------------------

    def saved(
        self, step: int, directory: str | os.PathLike[str], weights: Mapping[str, torch.Tensor]
    ) -> None:
        """The framework has written its checkpoint of `step` into `directory` (plain files);
        `weights` are the model's tensors, whose digest the checkpoint carries."""
        ctx = self.ctx
        if step != ctx.step:
            raise ValueError(f"saved({step}) at step {ctx.step}: save the step just ended")
        ctx._checkpoints.raise_failed()
        self._close_row()  # the step's own metrics come before the checkpoint's window
        staged = self._stage(Path(directory), step)
        began = time.perf_counter()
        taken = ctx._checkpoints.state(step, ctx.cursor, weights=dict(weights))
        taken[1]["external"] = sorted(p.name for p in staged.iterdir())
        if ctx.tracking is not None:  # the rows no commit has kept yet (baton.tracking.rows)
            taken[1][TRACKING_SLOT] = {"rows": [[s, ms, dict(m)] for s, ms, m in
                                                ctx.tracking.rows.state["rows"]]}  # fmt: skip
        final = step >= ctx.total_steps
        if not final:
            ctx._witness.checkpointed(step)
        ctx._checkpoints.write(
            step, ctx.token, taken, final=final, metrics=ctx._metrics, staged=staged, began=began
        )
        if ctx.should_stop and not final:
            ctx.finished_early = True

    def _stage(self, directory: Path, step: int) -> Path:
        """The checkpoint's files, linked (copied across file systems) where the framework
        cannot touch them, checked to be storable before anything is stored."""
        if not directory.is_dir():
            raise FileNotFoundError(f"no checkpoint directory {directory}")
        limit = MAX_NAME - len(rank_prefix(self.ctx.rank) + checkpoint_files.FILE_PREFIX)
        entries = sorted(directory.iterdir())
        for path in entries:
            if not path.is_file():
                raise ValueError(f"{path}: a checkpoint directory must hold plain files only")
            if not _NAME.fullmatch(path.name) or len(path.name) > limit:
                raise ValueError(f"{path.name!r}: a checkpoint file name must match"
                                 f" {_NAME.pattern} and be at most {limit} characters")  # fmt: skip
        staged = self.ctx._spool / f"{rank_prefix(self.ctx.rank)}staged-{step}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for path in entries:
            try:
                os.link(path, staged / path.name)
            except OSError:
                shutil.copy2(path, staged / path.name)
        return staged
