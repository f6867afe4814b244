"""W&B's run files read back (`baton.tracking.wandb_files`), as W&B's own client writes
them: records split across blocks, a file torn mid-record, and a file read on as it grows."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.tracking import wandb_files

WANDB_ID = "files-test"


@pytest.fixture
def offline(tmp_path: Path) -> Iterator[Any]:
    """An offline W&B run under `tmp_path`; W&B's service process stopped at the end."""
    import wandb

    saved = dict(os.environ)
    os.environ["WANDB_SILENT"] = "true"
    run = wandb.init(id=WANDB_ID, project="p", mode="offline", dir=str(tmp_path))
    try:
        yield run
    finally:
        wandb.finish()
        wandb.teardown()
        os.environ.clear()
        os.environ.update(saved)


def written(run: Any) -> None:
    """The run finished and its file written whole: `finish` returns before W&B's service
    process has written everything; stopping the service waits for it."""
    import wandb

    run.finish()
    wandb.teardown()


def test_rows_across_blocks_and_a_torn_tail(tmp_path: Path, offline: Any) -> None:
    big = "x" * (3 * wandb_files.BLOCK)  # one record in four fragments
    for step in range(5):
        offline.log({"loss": 1.0 / (step + 1), "note": big if step == 2 else "-"}, step=step)
    folder = Path(offline.dir).parent
    written(offline)
    rows = wandb_files.history(folder.parent, WANDB_ID)
    assert [(s, v["loss"]) for s, v in rows] == [(s, 1.0 / (s + 1)) for s in range(5)], rows
    assert rows[2][1]["note"] == big

    # A copy torn inside the big row's record: the rows before it, nothing after.
    path = folder / f"run-{WANDB_ID}.wandb"
    data = path.read_bytes()
    torn = tmp_path / "torn" / f"offline-run-20990101_000000-{WANDB_ID}"
    torn.mkdir(parents=True)
    cut = data.index(big[:100].encode()) + wandb_files.BLOCK
    (torn / path.name).write_bytes(data[:cut])
    assert [s for s, _ in wandb_files.history(torn.parent, WANDB_ID)] == [0, 1]
    assert wandb_files.newest_step(torn, WANDB_ID) == 1


def test_a_tail_reads_on_from_where_it_stopped(tmp_path: Path, offline: Any) -> None:
    folder = Path(offline.dir).parent
    path = folder / f"run-{WANDB_ID}.wandb"
    for step in range(3):
        offline.log({"loss": float(step)}, step=step)
    written(offline)
    whole = path.read_bytes()
    grown = tmp_path / "grown.wandb"
    first = whole.index(b"loss") + 200  # part way into the file
    grown.write_bytes(whole[:first])
    tail = wandb_files.Tail(grown)
    assert tail.read() in (-1, 0)
    with grown.open("ab") as f:
        f.write(whole[first:])
    assert tail.read() == 2
    shutil.copy(grown, tmp_path / "again.wandb")
    assert wandb_files.Tail(tmp_path / "again.wandb").read() == 2


def test_a_file_of_something_else_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / f"run-20990101_000000-{WANDB_ID}"
    folder.mkdir()
    (folder / f"run-{WANDB_ID}.wandb").write_bytes(b"not a run file at all")
    with pytest.raises(ValueError, match="not a W&B run file"):
        wandb_files.history(tmp_path, WANDB_ID)


def test_folders_are_the_runs_own_oldest_first(tmp_path: Path) -> None:
    for name in (
        f"offline-run-20990101_000002-{WANDB_ID}",
        f"offline-run-20990101_000001-{WANDB_ID}-1",
        f"offline-run-20990101_000001-{WANDB_ID}",
        f"run-20990101_000003-{WANDB_ID}",
        f"offline-run-20990101_000000-other-{WANDB_ID}",
        f"offline-run-20990101_000000-{WANDB_ID}x",
    ):
        (tmp_path / name).mkdir()
    assert [p.name for p in wandb_files.folders(tmp_path, WANDB_ID)] == [
        f"offline-run-20990101_000001-{WANDB_ID}",
        f"offline-run-20990101_000001-{WANDB_ID}-1",
        f"offline-run-20990101_000002-{WANDB_ID}",
        f"run-20990101_000003-{WANDB_ID}",
    ]
