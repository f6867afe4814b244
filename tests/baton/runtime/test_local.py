"""Local snapshots (`baton.runtime.local`): an attempt that dies between checkpoints resumes
on its host at the step it reached, bitwise the run it would have been, and only while the
store's chain still leads there."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from baton.runtime.context import RunContext
from baton.runtime.guard import GuardTripped
from baton.runtime.local import MARK, LocalSnapshots, Mark
from shared.contracts import JobSpec, Pointer
from shared.contracts.child import Loaded
from tests.baton.harness import RUN, Run, spec


@pytest.fixture(autouse=True)
def _host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "host"
    monkeypatch.setenv("BATON_SNAPSHOTS", str(root))
    return root


def job(total: int = 12, every: int = 4, local: float | None = 0.0) -> JobSpec:
    checkpoint = {"every_steps": every, "keep_last": 10, "local_every_seconds": local}
    return msgspec.structs.replace(spec(total), checkpoint=msgspec.convert(
        checkpoint, type(spec().checkpoint)))  # fmt: skip


def training(ctx: RunContext) -> Callable[[int], None]:
    """A model with dropout and Adam: its RNG and optimizer state must come back too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ctx.restore(model=model, optimizer=opt)

    def body(step: int) -> None:
        local = ctx._checkpoints.local
        if local is not None:  # steps here take microseconds: let every one be kept
            local.wait()
        x = torch.full((2, 4), float(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())

    return body


def loaded(run: Run) -> Loaded:
    return next(m for m in run.sent if isinstance(m, Loaded))


def newest(root: Path) -> Mark:
    (slot,) = root.iterdir()
    snaps = sorted(slot.glob("snap-*"))
    return msgspec.json.decode((snaps[-1] / MARK).read_bytes(), type=Mark)


def test_a_killed_attempt_resumes_at_its_local_snapshot_bitwise(
    tmp_path: Path, _host: Path
) -> None:
    whole = Run(tmp_path / "whole", job(local=None))
    reference = whole.attempt(training).checkpoints()[-1].digest

    run = Run(tmp_path / "cut", job())
    run.attempt(training, until=7)  # checkpoints at 4 committed; dies after step 7
    reached = newest(_host).step
    assert reached == 6, "the state at the last step boundary it passed"
    final = run.attempt(training).checkpoints()[-1]
    assert loaded(run).step == reached and loaded(run).local
    assert final.digest == reference
    assert not any(_host.iterdir()), "a completed run leaves no slot behind"


def test_a_snapshot_behind_a_newer_commit_or_a_rollback_is_not_resumed() -> None:
    base = Pointer(run_id=RUN, token=3, step=40, manifest="m40")
    mark = Mark(run_id=RUN, step=57, token=4, first_token=3, base=base)
    assert mark.continues(base)
    own = Pointer(run_id=RUN, token=4, step=50, manifest="m50")
    assert mark.continues(own), "a checkpoint its own attempt committed"
    assert not mark.continues(Pointer(run_id=RUN, token=5, step=50, manifest="m50"))
    assert not mark.continues(Pointer(run_id=RUN, token=5, step=40, manifest="m40")), "rollback"
    assert not mark.continues(Pointer(run_id=RUN, token=4, step=60, manifest="m60")), "behind"
    assert not mark.continues(Pointer(run_id=RUN, token=5, step=0, manifest="")), "a fence"
    assert not mark.continues(None)
    fresh = Mark(run_id=RUN, step=9, token=1, first_token=1, base=None)
    assert fresh.continues(None)


def test_a_commit_by_another_attempt_discards_the_host_s_snapshot(
    tmp_path: Path, _host: Path
) -> None:
    run = Run(tmp_path / "r", job())
    run.attempt(training, until=7)
    assert newest(_host).step > 4
    # Another host's attempt (its own snapshots elsewhere) commits step 8.
    os.environ["BATON_SNAPSHOTS"] = str(tmp_path / "elsewhere")
    run.attempt(training, until=9)
    os.environ["BATON_SNAPSHOTS"] = str(_host)
    run.attempt(training)
    assert loaded(run).step == 8 and not loaded(run).local


def test_a_zombie_on_the_host_cannot_feed_a_later_attempt(tmp_path: Path) -> None:
    root = tmp_path / "host"
    zombie = LocalSnapshots(root, "file:///s", RUN, token=1, every_s=0.0)
    assert zombie.find(None) is None
    state = {"w": {"x": torch.ones(2)}}
    zombie.take(3, 1, state, {"step": 3})
    zombie.wait()
    heir = LocalSnapshots(root, "file:///s", RUN, token=2, every_s=0.0)
    found = heir.find(None)
    assert found is not None and found[1].step == 3
    zombie.take(9, 1, state, {"step": 9})  # after the heir's claim: refused
    zombie.close()
    assert not zombie.on
    later = LocalSnapshots(root, "file:///s", RUN, token=3, every_s=0.0)
    assert later.find(None) is None, "the zombie's step 3 was the heir's to resume, not later"
    for s in (heir, later):
        s.close()


def test_a_host_that_cannot_keep_snapshots_trains_on(
    tmp_path: Path, _host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _host.write_text("not a directory")
    run = Run(tmp_path / "r", job())
    run.attempt(training, until=6)
    assert "baton: local snapshots off: cannot read" in capsys.readouterr().err
    final = run.attempt(training).checkpoints()[-1]
    assert loaded(run).step == 4 and final.step == 12


def test_a_tripped_guard_takes_the_host_s_snapshots_with_it(tmp_path: Path, _host: Path) -> None:
    """The steps since the last checkpoint are unvetted: the run goes on from the store."""
    run = Run(tmp_path / "r", job())

    def blows_up(ctx: RunContext) -> Callable[[int], None]:
        body = training(ctx)

        def step(n: int) -> None:
            body(n)
            if n == 6:
                ctx.report(loss=math.nan)

        return step

    with pytest.raises(GuardTripped):
        run.attempt(blows_up)
    assert not list(_host.glob("*/snap-*"))
    run.attempt(training)  # (the harness commits nothing of an attempt that raised)
    assert loaded(run).step == 0 and not loaded(run).local


def test_an_attempt_behind_the_newest_checkpoint_resumes_no_snapshot(tmp_path: Path) -> None:
    """Past a damaged newest checkpoint the attempt resumes behind `latest`: nothing taken
    before continues it, and a snapshot half written by a killed writer is cleared."""
    root = tmp_path / "host"
    first = LocalSnapshots(root, "file:///s", RUN, token=1, every_s=0.0)
    assert first.find(None) is None
    first.take(5, 1, {"w": {"x": torch.ones(2)}}, {"step": 5})
    first.close()
    (first.slot / ".tmp-1-6-999").mkdir()
    latest = Pointer(run_id=RUN, token=1, step=3, manifest="m3")
    later = LocalSnapshots(root, "file:///s", RUN, token=2, every_s=0.0)
    assert later.find(latest, behind=True) is None and later.base is None
    assert not list(first.slot.glob(".tmp-*")) and not list(first.slot.glob("snap-*"))
    later.close()


class _Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def loader_training(ctx: RunContext) -> Callable[[int], None]:
    """User-shaped: a shuffling data loader with a worker, AdamW and a cosine schedule, so
    the data position, the sampler's generator and the scheduler come back from the host."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.total_steps)
    batches = ctx.data_loader(_Numbers(), batch_size=5, num_workers=1)
    ctx.restore(model=model, optimizer=opt, scheduler=sched)

    def body(step: int) -> None:
        local = ctx._checkpoints.local
        if local is not None:
            local.wait()
        loss = model(next(batches)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ctx.report(loss=loss.item())

    return body


def test_a_data_loader_s_run_resumes_at_its_local_snapshot_bitwise(
    tmp_path: Path, _host: Path
) -> None:
    whole = Run(tmp_path / "whole", job(total=14, local=None))
    reference = whole.attempt(loader_training).checkpoints()[-1].digest
    run = Run(tmp_path / "cut", job(total=14))
    run.attempt(loader_training, until=7)  # mid-epoch (24 samples, 5 a batch), past step 4
    final = run.attempt(loader_training).checkpoints()[-1]
    assert loaded(run).local and loaded(run).step == 6
    assert final.digest == reference
