"""`RunContext`: the whole API a training entry point sees.

    def train(ctx: RunContext) -> None:
        model, opt = build(ctx.config)
        ctx.restore(model=model, optimizer=opt)      # no-op on a fresh run
        for step in ctx.steps():                     # resumes at the committed step
            loss = ...
            ctx.report(loss=loss.item())

`steps()` takes care of everything else: checkpoints on the job's policy or when the trainer
asks (preemption), stopping when told to, and the final checkpoint. Resume is exact when the
job is deterministic: everything registered with `restore()` (`baton.runtime.slots` says what can
be), the data cursor and the global RNGs are restored, and a checkpoint holds each of them
as it was at the step it names. `data_loader()` gives the common case's data position.

In deterministic mode a run also checks itself: an attempt that resumes compares its first
steps' metrics with what an earlier attempt reported after the same checkpoint, and tells
the trainer if they differ (`baton.runtime.witness`).
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from baton.runtime import witness
from baton.runtime.data import Batches
from baton.runtime.slots import Slot, slot_for
from baton.runtime.snapshot import Snapshotter
from shared.checkpoint import commit
from shared.checkpoint import files as checkpoint_files
from shared.checkpoint.digest import weights_digest
from shared.checkpoint.store import open_store
from shared.checkpoint.tensors import declared, specs_of
from shared.contracts import FileRef, Manifest, Task, spec_hash
from shared.contracts.child import CheckpointReady, Divergence, FromChild, Loaded, StepDone
from shared.errors import IntegrityError, NotFound

REPORT_INTERVAL_S = 0.2


class RunContext:
    def __init__(
        self,
        task: Task,
        token: int,
        store_url: str,
        spool: Path,
        send: Callable[[FromChild], None],
        launched_at: float | None = None,
    ) -> None:
        self._launched_at = time.monotonic() if launched_at is None else launched_at
        """When the training process was handed the task (monotonic): the entry point's own
        set-up is what passes between it and `restore()`."""
        self.run_id = task.run_id
        self.spec = task.spec
        self.config: dict[str, Any] = dict(task.spec.config)
        self.seed = task.spec.seed
        self.total_steps = task.spec.total_steps
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.step = 0
        """Steps completed so far; the next step to run."""
        self.cursor: dict[str, Any] = {}
        """JSON-able position in the data, saved with every checkpoint (as it is when the
        checkpoint is taken, between steps). Entry points that derive their batches from
        `step`, or draw them from `data_loader()`, need not use it."""
        self.token = token
        self._store_url = store_url
        self._send = send
        self._slots: list[Slot] = []
        self._loaders: dict[str, Batches] = {}
        self._metrics: dict[str, float] = {}
        self._step_metrics: dict[str, float] = {}
        self._witness = witness.Witness(enabled=task.spec.deterministic)
        self._snap = Snapshotter(store_url, spool)
        self._lock = threading.Lock()
        self._want_checkpoint = False
        self._want_stop = False
        self._last_saved = -1
        self._last_ckpt_time = time.monotonic()
        self._postponed = False
        self._last_report = 0.0
        self._write_error: BaseException | None = None
        self.finished_early = False

    # -- the public API ------------------------------------------------------------------

    def restore(self, **state: Any) -> int:
        """Register what to checkpoint and load the newest committed checkpoint into it, if
        there is one. Returns the step to continue from.

        Accepted: objects with `state_dict()`/`load_state_dict()` (model, optimizer,
        scheduler, `GradScaler`, torchdata's `StatefulDataLoader` — its generator included),
        `torch.Generator` objects, and dicts/lists of JSON values (put back in place). The
        first registered object's tensors are the weights the run's digest is taken of.
        Anything else is refused with a `TypeError` naming it."""
        registered = {**state, **{n: b for n, b in self._loaders.items() if n not in state}}
        if not registered:
            raise ValueError("restore() needs at least one object, e.g. restore(model=model)")
        if self._slots:
            raise RuntimeError("restore() registers state once per run; call it once")
        seen: dict[int, str] = {}
        for name, obj in registered.items():
            if id(obj) in seen and not isinstance(obj, bool | int | float | str):
                raise ValueError(f"restore(): {name!r} is the same object as {seen[id(obj)]!r}")
            seen[id(obj)] = name
        self._slots = [slot_for(name, obj) for name, obj in registered.items()]
        began = time.monotonic()
        manifest, damaged, rows = asyncio.run(self._find_checkpoint())
        if manifest is not None:
            self._load(manifest)
        took = time.monotonic() - began
        self._witness.resumed(self.step, rows)
        setup = max(0.0, began - self._launched_at)
        self._send(Loaded(step=self.step, damaged=damaged, took_s=took, setup_s=setup))
        return self.step

    def data_loader(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int | None = None,
        name: str = "data",
        **loader_options: Any,
    ) -> Batches:
        """An endless stream of batches over a map-style dataset, reshuffled every epoch
        from the run's seed (or `seed`), that resumes mid-epoch at exactly the next batch,
        with any `num_workers`. Registered under `name` by itself: call this before
        `restore()`, then draw one batch per step:

            batches = ctx.data_loader(dataset, batch_size=32, num_workers=2)
            ctx.restore(model=model, optimizer=opt)
            for step in ctx.steps():
                x, y = next(batches)

        Extra keyword arguments go to torchdata's `StatefulDataLoader` (`pin_memory`, …)."""
        if self._slots:
            raise RuntimeError("call data_loader() before restore(), which loads its position")
        if name in self._loaders:
            raise ValueError(f"a data loader named {name!r} is registered already")
        batches = Batches(
            dataset,
            batch_size=batch_size,
            seed=self.seed if seed is None else seed,
            shuffle=shuffle,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn,
            **loader_options,
        )
        self._loaders[name] = batches
        return batches

    def steps(self) -> Iterator[int]:
        """Yield step numbers from the resume point to `total_steps`, checkpointing as
        the policy says and stopping (after a checkpoint) when the trainer asks."""
        if not self._slots:
            raise RuntimeError("call ctx.restore(model=..., ...) before ctx.steps()")
        while self.step < self.total_steps:
            if self.should_stop:
                self._save(final=False)
                self.finished_early = True
                return
            yield self.step
            self.step += 1
            self._after_step()
        self._save(final=True)

    def report(self, **metrics: float) -> None:
        """Record metrics for the current step (loss, accuracy, …); sent to the trainer."""
        values = {k: float(v) for k, v in metrics.items()}
        self._metrics.update(values)
        self._step_metrics.update(values)

    def checkpoint(self) -> None:
        """Checkpoint now. Blocks only for the copy into host memory."""
        self._save(final=False)

    @property
    def should_stop(self) -> bool:
        with self._lock:
            return self._want_stop

    # -- called by the child's control thread --------------------------------------------

    def request(self, action: str, token: int = 0) -> None:
        with self._lock:
            if action == "checkpoint":
                self._want_checkpoint = True
            elif action == "stop":
                self._want_stop = True
            elif action == "token" and token > self.token:
                self.token = token

    def close(self) -> None:
        self._snap.close()
        if self._write_error is not None:
            raise RuntimeError("writing a checkpoint failed") from self._write_error

    # -- internals -----------------------------------------------------------------------

    def _after_step(self) -> None:
        self._check_step()
        now = time.monotonic()
        policy = self.spec.checkpoint
        with self._lock:
            asked, self._want_checkpoint = self._want_checkpoint, False
        periodic = (
            self._postponed
            or (policy.every_steps is not None and self.step % policy.every_steps == 0)
            or (
                policy.every_seconds is not None
                and now - self._last_ckpt_time >= policy.every_seconds
            )
        )
        # A periodic checkpoint never waits for the write before it (see baton.runtime.snapshot):
        # it is postponed to the first step after that write is done. Asked-for ones wait.
        save = self.step < self.total_steps and (asked or (periodic and not self._snap.busy))
        self._postponed = periodic and not save and self.step < self.total_steps
        if now - self._last_report >= REPORT_INTERVAL_S or save or self.step == self.total_steps:
            self._last_report = now
            self._send(StepDone(step=self.step, metrics=dict(self._metrics)))
        if save:
            self._save(final=False)

    def _save(self, final: bool) -> None:
        if self._write_error is not None:
            raise RuntimeError("writing a checkpoint failed") from self._write_error
        if self.step == self._last_saved and not final:
            return
        groups: dict[str, dict[str, torch.Tensor]] = {}
        trees: dict[str, Any] = {}
        for slot in self._slots:
            groups[slot.name] = {}
            trees[slot.name] = slot.capture(groups[slot.name])
        rng_tensors, rng_json = _rng_state()
        groups["rng"] = rng_tensors
        model = next(iter(groups.values()))
        digest = weights_digest(model)
        meta = {
            "run_id": self.run_id,
            "step": self.step,
            "cursor": self.cursor,
            "state": trees,
            "rng": rng_json,
            "spec_hash": spec_hash(self.spec),
            "digest": digest,
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        }
        try:
            snap, stalled = self._snap.capture(self.step, groups, meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"ctx.cursor must hold only JSON values: {exc}") from None
        token, metrics = self.token, dict(self._metrics)
        if not final:
            self._witness.checkpointed(self.step)

        def done(files: list[FileRef]) -> None:
            self._send(
                CheckpointReady(
                    step=snap.step,
                    token=token,
                    files=files,
                    final=final,
                    digest=digest,
                    metrics=metrics,
                    stall_s=stalled,
                )
            )

        def failed(exc: BaseException) -> None:
            self._write_error = exc

        self._snap.write_async(snap, self.run_id, token, done, failed)
        self._last_saved = self.step
        self._last_ckpt_time = time.monotonic()
        self._postponed = False

    def _check_step(self) -> None:
        """The step just done, against the witness of the checkpoint it follows."""
        metrics, self._step_metrics = self._step_metrics, {}
        complete, diverged = self._witness.stepped(self.step, metrics)
        for start, rows in complete:
            self._snap.write_witness(commit.witness_key(self.run_id, start), witness.encode(rows))
        if diverged is not None:
            self._send(
                Divergence(
                    checkpoint=diverged.checkpoint,
                    step=diverged.step,
                    metric=diverged.metric,
                    expected=repr(diverged.expected),
                    got=repr(diverged.got),
                )
            )

    async def _find_checkpoint(
        self,
    ) -> tuple[Manifest | None, list[int], list[witness.Row] | None]:
        async with open_store(self._store_url) as store:
            manifest, damaged = await commit.restorable(store, self.run_id)
            if manifest is None or not self._witness.enabled:
                return manifest, damaged, None
            try:
                data = await store.get(commit.witness_key(self.run_id, manifest.step))
            except NotFound:
                return manifest, damaged, None
            return manifest, damaged, witness.decode(data, manifest.step)

    def _load(self, manifest: Manifest) -> None:
        """Load a checkpoint that `commit.restorable` verified. Every file's tensors are
        checked again here, against meta.json and against the objects they go into, before
        any object is touched: a mismatch is refused naming the tensor and leaves the
        objects as they were, where `load_state_dict` would fail half-way with torch's
        message."""
        step, suffix = manifest.step, checkpoint_files.SUFFIX
        with tempfile.TemporaryDirectory(prefix="baton-restore-") as tmp:
            local = asyncio.run(_download(self._store_url, manifest.files, Path(tmp)))
            if checkpoint_files.META not in local or f"rng{suffix}" not in local:
                raise IntegrityError(f"checkpoint {step} lacks meta.json or rng{suffix}")
            meta = checkpoint_files.read_meta(local[checkpoint_files.META])
            if meta.get("run_id") != self.run_id or meta.get("spec_hash") != spec_hash(self.spec):
                raise IntegrityError(f"checkpoint {step} belongs to another run or job spec")
            state, cursor, saved = meta.get("state"), meta.get("cursor"), meta.get("step")
            if not (isinstance(state, dict) and isinstance(cursor, dict) and type(saved) is int):
                raise IntegrityError(f"checkpoint {step}: meta.json lacks state, cursor or step")
            for slot in self._slots:
                name = slot.name
                if f"{name}{suffix}" not in local or name not in state:
                    raise IntegrityError(f"checkpoint {step} has no state for {name!r}")
                live = slot.live()
                checkpoint_files.check_tensors(
                    local[f"{name}{suffix}"],
                    f"{name}{suffix}",
                    recorded=declared(state[name]),
                    live=live,
                    live_name=f"the {name} being restored",
                )
            checkpoint_files.check_tensors(
                local[f"rng{suffix}"],
                f"rng{suffix}",
                live=specs_of(_rng_state()[0]),
                live_name="this process's RNG",
                required=("torch", "numpy"),
            )
            # Objects, then data loaders, then generators (`baton.runtime.slots`); the global
            # RNGs last.
            for slot in sorted(self._slots, key=lambda s: s.phase):
                name = slot.name
                tensors = checkpoint_files.load_tensors(local[f"{name}{suffix}"], f"{name}{suffix}")
                try:
                    slot.load(state[name], tensors)
                except RecursionError:
                    raise IntegrityError(f"checkpoint {step}: {name!r} nested too deeply") from None
                except (KeyError, TypeError, ValueError) as exc:
                    raise IntegrityError(
                        f"checkpoint {step}: cannot restore {name!r}: {exc}"
                    ) from exc
            rng = checkpoint_files.load_tensors(local[f"rng{suffix}"], f"rng{suffix}")
            try:
                _set_rng_state(rng, meta["rng"])
            except (KeyError, TypeError, ValueError) as exc:
                raise IntegrityError(f"checkpoint {step}: malformed RNG state: {exc!r}") from None
        self.step = saved
        self.cursor.clear()  # in place, like registered dicts: a reference taken earlier
        self.cursor.update(cursor)  # is still the one saved
        self._last_saved = self.step
        self._last_ckpt_time = time.monotonic()


async def _download(store_url: str, files: list[FileRef], into: Path) -> dict[str, Path]:
    out = {}
    async with open_store(store_url) as store:
        for ref in files:
            # A name becomes a local path here: refuse one that would land outside `into`,
            # whatever checks the manifest passed before.
            path = into / checkpoint_files.check_name(ref.name)
            if path.parent != into or ref.name in out:
                raise IntegrityError(f"checkpoint file {ref.name!r} cannot be downloaded")
            out[ref.name] = path
            await store.download(ref.key, path)
    return out


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss_next = random.getstate()
    return tensors, {
        "numpy": [kind, int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss_next],
    }


def _set_rng_state(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = js["python"]
    random.setstate((version, tuple(internal), gauss_next))
