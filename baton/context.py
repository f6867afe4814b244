"""`RunContext`: the whole API a training entry point sees.

    def train(ctx: RunContext) -> None:
        model, opt = build(ctx.config)
        ctx.restore(model=model, optimizer=opt)      # no-op on a fresh run
        for step in ctx.steps():                     # resumes at the committed step
            loss = ...
            ctx.report(loss=loss.item())

`steps()` takes care of everything else: checkpoints on the job's policy or when the trainer
asks (preemption), stopping when told to, and the final checkpoint. Resume is exact when the
job is deterministic: weights, optimizer state, the data cursor and every RNG are restored.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file

from baton.snapshot import Snapshotter
from shared import commit
from shared.contracts import FileRef, Manifest, Task, spec_hash
from shared.contracts.child import CheckpointReady, FromChild, Restored, StepDone
from shared.digest import weights_digest
from shared.errors import IntegrityError
from shared.store import open_store
from shared.tensors import flatten, unflatten

REPORT_INTERVAL_S = 0.2


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


class RunContext:
    def __init__(
        self,
        task: Task,
        token: int,
        store_url: str,
        spool: Path,
        send: Callable[[FromChild], None],
    ) -> None:
        self.run_id = task.run_id
        self.spec = task.spec
        self.config: dict[str, Any] = dict(task.spec.config)
        self.seed = task.spec.seed
        self.total_steps = task.spec.total_steps
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.step = 0
        """Steps completed so far; the next step to run."""
        self.cursor: dict[str, Any] = {}
        """JSON-able position in the data, saved with every checkpoint. Entry points that
        derive their batches from `step` need not use it."""
        self.token = token
        self._store_url = store_url
        self._send = send
        self._state: dict[str, Stateful] = {}
        self._metrics: dict[str, float] = {}
        self._snap = Snapshotter(store_url, spool)
        self._lock = threading.Lock()
        self._want_checkpoint = False
        self._want_stop = False
        self._last_saved = -1
        self._last_ckpt_time = time.monotonic()
        self._last_report = 0.0
        self._write_error: BaseException | None = None
        self.finished_early = False

    # -- the public API ------------------------------------------------------------------

    def restore(self, **state: Stateful) -> int:
        """Register what to checkpoint (model, optimizer, scheduler, …) and load the newest
        committed checkpoint into it, if there is one. Returns the step to continue from."""
        if not state:
            raise ValueError("restore() needs at least one object, e.g. restore(model=model)")
        self._state = dict(state)
        manifest, damaged = asyncio.run(self._find_checkpoint())
        if manifest is not None:
            self._load(manifest)
        self._send(Restored(step=self.step, damaged=damaged))
        return self.step

    def steps(self) -> Iterator[int]:
        """Yield step numbers from the resume point to `total_steps`, checkpointing as
        the policy says and stopping (after a checkpoint) when the trainer asks."""
        if not self._state:
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
        self._metrics.update({k: float(v) for k, v in metrics.items()})

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
        now = time.monotonic()
        policy = self.spec.checkpoint
        with self._lock:
            asked, self._want_checkpoint = self._want_checkpoint, False
        due = (
            asked
            or (policy.every_steps is not None and self.step % policy.every_steps == 0)
            or (
                policy.every_seconds is not None
                and now - self._last_ckpt_time >= policy.every_seconds
            )
        )
        if now - self._last_report >= REPORT_INTERVAL_S or due or self.step == self.total_steps:
            self._last_report = now
            self._send(StepDone(step=self.step, metrics=dict(self._metrics)))
        if due and self.step < self.total_steps:
            self._save(final=False)

    def _save(self, final: bool) -> None:
        if self._write_error is not None:
            raise RuntimeError("writing a checkpoint failed") from self._write_error
        if self.step == self._last_saved and not final:
            return
        groups: dict[str, dict[str, torch.Tensor]] = {}
        trees: dict[str, Any] = {}
        for name, obj in self._state.items():
            tensors: dict[str, torch.Tensor] = {}
            trees[name] = flatten(obj.state_dict(), name, tensors)
            groups[name] = tensors
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
        snap, stalled = self._snap.capture(self.step, groups, meta)
        token, metrics = self.token, dict(self._metrics)

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

    async def _find_checkpoint(self) -> tuple[Manifest | None, list[int]]:
        async with open_store(self._store_url) as store:
            return await commit.restorable(store, self.run_id)

    def _load(self, manifest: Manifest) -> None:
        with tempfile.TemporaryDirectory(prefix="baton-restore-") as tmp:
            local = asyncio.run(_download(self._store_url, manifest.files, Path(tmp)))
            meta = json.loads(local["meta.json"].read_text())
            if meta.get("run_id") != self.run_id or meta.get("spec_hash") != spec_hash(self.spec):
                raise IntegrityError(
                    f"checkpoint {manifest.step} belongs to another run or job spec"
                )
            for name, obj in self._state.items():
                if f"{name}.safetensors" not in local or name not in meta["state"]:
                    raise IntegrityError(f"checkpoint {manifest.step} has no state for {name!r}")
                tensors = load_file(str(local[f"{name}.safetensors"]))
                obj.load_state_dict(unflatten(meta["state"][name], tensors))
            _set_rng_state(load_file(str(local["rng.safetensors"])), meta["rng"])
        self.step = int(meta["step"])
        self.cursor = dict(meta["cursor"])
        self._last_saved = self.step
        self._last_ckpt_time = time.monotonic()


async def _download(store_url: str, files: list[FileRef], into: Path) -> dict[str, Path]:
    out = {}
    async with open_store(store_url) as store:
        for ref in files:
            out[ref.name] = into / ref.name
            await store.download(ref.key, out[ref.name])
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
