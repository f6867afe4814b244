"""A checkpoint is a consistent snapshot, and every kind of state a user holds can be
registered: the real RunContext and its background writer, the real commit protocol on a
file store, attempts that stop mid-run and resume."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from baton.runtime.context import RunContext
from baton.runtime.snapshot import Snapshot, Snapshotter
from shared.contracts import FileRef
from tests.baton.harness import Run, spec


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_each_checkpoint_holds_the_cursor_metrics_and_state_of_its_own_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cursor, a registered dict and a metric change after every step while each
    checkpoint is still being written in the background: the writer is held until the loop
    is two steps further on. Every checkpoint must still hold its own step's values.
    (Checkpoints are asked for every third step: a periodic one would be postponed while
    the writer is held, and the loop would finish before a second one came due.)"""
    contexts: list[RunContext] = []
    moved_on = threading.Condition()
    write = Snapshotter._write

    def slow_write(self: Snapshotter, snap: Snapshot, run_id: str, token: int) -> list[FileRef]:
        ctx = contexts[0]
        with moved_on:  # the loop is past this step before the writer reads anything
            moved_on.wait_for(lambda: ctx.step >= min(snap.step + 2, ctx.total_steps), 30)
        return write(self, snap, run_id, token)

    monkeypatch.setattr(Snapshotter, "_write", slow_write)
    run = Run(tmp_path, spec(total=12, every=100))

    def setup(ctx: RunContext) -> Callable[[int], None]:
        contexts.append(ctx)
        progress: dict[str, Any] = {"done": 0, "seen": []}
        ctx.restore(model=model(), progress=progress)
        ctx.cursor.update(offset=0, seen=[])

        def body(step: int) -> None:
            with moved_on:
                moved_on.notify_all()  # ctx.step is `step`: the steps before are done
            if step and step % 3 == 0:
                ctx.checkpoint()
            ctx.cursor["offset"] = step + 1
            ctx.cursor["seen"].append(step)  # a nested value, changed in place
            progress["done"] = step + 1
            progress["seen"].append(step)
            ctx.report(loss=float(step + 1))

        return body

    attempt = run.attempt(setup)
    ready = attempt.checkpoints()
    assert [r.step for r in ready] == [3, 6, 9, 12], [r.step for r in ready]
    for r in ready:
        meta = run.meta(r)
        n = meta["step"]
        assert n == r.step
        assert meta["cursor"] == {"offset": n, "seen": list(range(n))}, (n, meta["cursor"])
        tree = meta["state"]["progress"]["__dict__"]
        assert tree == [["done", n], ["seen", list(range(n))]], (n, tree)
        assert r.metrics == {"loss": float(n)}, (n, r.metrics)


def test_a_registered_generator_is_restored(tmp_path: Path) -> None:
    """An attempt dies after step 8 with step 5 committed; the next resumes at 5 and its
    generator draws exactly what the first one drew from step 5 on."""
    run = Run(tmp_path, spec(total=10, every=5))
    draws: list[list[float]] = []

    def setup(ctx: RunContext) -> Callable[[int], None]:
        g = torch.Generator().manual_seed(1234)
        mine: list[float] = []
        draws.append(mine)
        ctx.restore(model=model(), sampler_rng=g)

        def body(step: int) -> None:
            mine.append(torch.rand(1, generator=g).item())

        return body

    run.attempt(setup, until=8, commit_upto=5)
    second = run.attempt(setup)
    assert second.ctx.step == 10
    assert draws[1] == draws[0][5:8] + draws[1][3:], "the generator restarted or drifted"
    reference = Run(tmp_path / "ref", spec(total=10, every=5))
    reference.attempt(setup)
    assert draws[1] == draws[2][5:], "the resumed draws differ from an uninterrupted run's"


def test_json_values_are_put_back_in_place(tmp_path: Path) -> None:
    run = Run(tmp_path, spec(total=6, every=3))
    at_start: list[Any] = []

    def setup(ctx: RunContext) -> Callable[[int], None]:
        best: dict[str, Any] = {"loss": float("inf"), "at": None}
        history: list[Any] = []
        ctx.restore(model=model(), best=best, history=history)
        at_start.append((ctx.step, dict(best), list(history)))

        def body(step: int) -> None:
            best.update(loss=1.0 / (step + 1), at=step)
            history.append({"step": step})

        return body

    run.attempt(setup, until=5, commit_upto=3)
    run.attempt(setup)
    step, best, history = at_start[1]
    assert step == 3, step
    assert best == {"loss": 1.0 / 3, "at": 2}, best
    assert history == [{"step": 0}, {"step": 1}, {"step": 2}], history


@pytest.mark.parametrize(
    ("obj", "needles"),
    [
        (DataLoader(TensorDataset(torch.zeros(4, 1))), ["loader", "DataLoader", "data_loader"]),
        (iter([1, 2]), ["loader", "list_iterator", "iterator"]),
        (0.1, ["loader", "builtins.float", "dict"]),
        ({"when": {1, 2}}, ["loader", "set"]),
        (object(), ["loader", "builtins.object", "state_dict"]),
    ],
    ids=["dataloader", "iterator", "float", "set-in-dict", "object"],
)
def test_what_cannot_be_checkpointed_is_refused_naming_it(
    tmp_path: Path, obj: Any, needles: list[str]
) -> None:
    run = Run(tmp_path, spec())

    def setup(ctx: RunContext) -> Callable[[int], None]:
        ctx.restore(model=model(), loader=obj)
        raise AssertionError("restore() accepted it")

    with pytest.raises(TypeError) as refused:
        run.attempt(setup)
    for needle in needles:
        assert needle in str(refused.value), (needle, str(refused.value))
    assert not list((tmp_path / "store").rglob("*.json")), "something was written"


def test_the_same_object_under_two_names_and_a_late_data_loader_are_refused(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, spec())
    m = model()

    def twice(ctx: RunContext) -> Callable[[int], None]:
        ctx.restore(model=m, again=m)
        raise AssertionError("restore() accepted it")

    with pytest.raises(ValueError, match="'again' is the same object as 'model'"):
        run.attempt(twice)

    def late(ctx: RunContext) -> Callable[[int], None]:
        ctx.restore(model=m)
        ctx.data_loader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
        raise AssertionError("data_loader() after restore() was accepted")

    with pytest.raises(RuntimeError, match="before restore"):
        run.attempt(late)


def test_a_cursor_that_is_not_json_is_refused_naming_the_cursor(tmp_path: Path) -> None:
    run = Run(tmp_path, spec(total=4, every=1))

    def setup(ctx: RunContext) -> Callable[[int], None]:
        ctx.restore(model=model())

        def body(step: int) -> None:
            ctx.cursor["order"] = torch.arange(3)  # a tensor in the cursor

        return body

    with pytest.raises(TypeError, match=r"ctx\.cursor must hold only JSON values"):
        run.attempt(setup)
