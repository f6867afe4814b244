"""One tracker run per Baton run, each step logged once: a job with its own loop that
reports its loss, configured with a tracker, kills its training process twice — mid-way
between two checkpoints, and in the step just before one — and completes; the tracker,
read back from its own storage, holds one run whose loss history (steps and values) is
the uninterrupted run's, reported by an identical job that nothing killed.

TensorBoard's event files are read by TensorBoard's own reader (`EventAccumulator`), both
Baton's (`<run>/baton`) and the user's own `SummaryWriter` (`ctx.tracking.summary_writer()`);
MLflow's run is read from a real tracking server (`mlflow server`, SQLite behind it);
W&B's, offline, from its own files (`baton.tracking.wandb_files`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from shared.bus import names
from shared.contracts import JobSpec, RunState
from shared.contracts.events import CheckpointCommitted, Preempted, Restored, Started
from shared.state.runs import Runs
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.slow, pytest.mark.frameworks, pytest.mark.asyncio(loop_scope="module")]

TOTAL = 40
HF_TOTAL = 30
KILLS = [13, 29]
"""Yielded steps whose body ends in a SIGKILL: 13 between checkpoints (10 and 20 steps
done), 29 in the step before the checkpoint of 30 steps done."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    root = tmp_path_factory.mktemp("tracking")
    pools = root / "pools.toml"
    pools.write_text("[pools.default]\nmin_run_s = 0\n")  # a run may be preempted at once
    env = {"BATON_POOLS_FILE": str(pools)}
    async with Stack(root / "stack", trainers=2, lease_ttl=3, env=env) as s:
        yield s


def tracked(tracking: dict[str, Any], marks: Path | None) -> JobSpec:
    config: dict[str, Any] = {"pace": 0.02}
    if marks is not None:
        marks.mkdir(parents=True, exist_ok=True)
        config |= {"kill_at": KILLS, "marks": str(marks)}
    return job(
        name="tracked", entry_point="tests.support.tracked:train", total_steps=TOTAL,
        checkpoint={"every_steps": 10}, config=config, tracking=tracking,
        idempotency_key=uuid.uuid4().hex,
    )  # fmt: skip


async def run_pair(stack: Stack, tracking: dict[str, Any], marks: Path) -> tuple[str, str]:
    """The killed run and the reference, submitted together; both completed."""
    nc = await stack.client()
    victim = await submit(nc, tracked(tracking, marks))
    reference = await submit(nc, tracked(tracking, None))
    for run_id in (victim, reference):
        record = await finished(nc, run_id, timeout=240)
        assert record.state is RunState.COMPLETED, (run_id, record.state)
    attempts = [e for e in await history(nc, victim) if isinstance(e, Started)]
    assert len(attempts) == 3, f"the victim ran {len(attempts)} attempts, not 3 (two kills)"
    return victim, reference


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


FRAMEWORK_KILLS = [13, 19]
"""A framework's global steps (1 for the first) at whose end its training process is
SIGKILLed (`tests.support.killing`): 13 between the checkpoints of 10 and 20 steps done,
19 in the step just before the one of 20."""


async def killed_twice(
    stack: Stack, lm: Callable[[Path | None], JobSpec], marks: Path
) -> tuple[str, str]:
    """`lm(None)`, the reference, and `lm(marks)`, killed at the end of its global steps
    `FRAMEWORK_KILLS`, submitted together: both completed, the victim in three attempts,
    each resumed from a checkpoint before the step it was killed at (steps redone).
    (reference, victim)."""
    nc = await stack.client()
    marks.mkdir(parents=True, exist_ok=True)
    victim = await submit(nc, lm(marks))
    reference = await submit(nc, lm(None))
    for run_id in (victim, reference):
        record = await finished(nc, run_id, timeout=240)
        assert record.state is RunState.COMPLETED, (run_id, record.state, record.reason)
    events = await history(nc, victim)
    attempts = [e for e in events if isinstance(e, Started)]
    assert len(attempts) == 3, f"the victim ran {len(attempts)} attempts, not 3 (two kills)"
    resumed = [e.step for e in events if isinstance(e, Restored)][-2:]
    assert len(resumed) == 2 and all(
        step < kill for step, kill in zip(resumed, FRAMEWORK_KILLS, strict=True)
    ), resumed
    return reference, victim


def hf_tracked(tracking: dict[str, Any], report_to: str) -> Callable[[Path | None], JobSpec]:
    """The Hugging Face example under `tracking`, the Trainer reporting to `report_to`;
    killed at `FRAMEWORK_KILLS` given the marks' folder."""

    def lm(marks: Path | None) -> JobSpec:
        config: dict[str, Any] = {"batch": 8, "window": 32, "stride": 8, "report_to": [report_to]}
        if marks is not None:
            config |= {"kill_at": FRAMEWORK_KILLS, "marks": str(marks)}
        return job(
            name="hf-tracked", entry_point="tests.support.killing:hf", total_steps=HF_TOTAL,
            seed=42, checkpoint={"every_steps": 10}, tracking=tracking, config=config,
            idempotency_key=uuid.uuid4().hex,
        )  # fmt: skip

    return lm


def pl_tracked(tracking: dict[str, Any]) -> Callable[[Path | None], JobSpec]:
    """The Lightning example under `tracking`, its default logger on (`logger=True`), one
    log a step; killed at `FRAMEWORK_KILLS` given the marks' folder."""

    def lm(marks: Path | None) -> JobSpec:
        config: dict[str, Any] = {
            "batch": 8, "window": 32, "stride": 8, "logger": True, "log_every": 1,
        }  # fmt: skip
        if marks is not None:
            config |= {"kill_at": FRAMEWORK_KILLS, "marks": str(marks)}
        return job(
            name="pl-tracked", entry_point="tests.support.killing:lightning",
            total_steps=HF_TOTAL, seed=42, checkpoint={"every_steps": 10}, tracking=tracking,
            config=config, idempotency_key=uuid.uuid4().hex,
        )  # fmt: skip

    return lm


def tracked_history_is_the_references(project: Path, reference: str, victim: str) -> None:
    """The tracked job's TensorBoard histories under `project`, Baton's rows
    (`<run>/baton`, `loss`) and the user's writer's (`<run>`, `user_loss`): the victim's
    are the reference's, one value for each of its `TOTAL` steps."""
    for tag, sub in (("loss", "baton"), ("user_loss", "")):
        want = scalars(project / reference / sub, tag)
        got = scalars(project / victim / sub, tag)
        assert [s for s, _ in want] == list(range(TOTAL)), want
        assert got == want, f"{tag}: {got} != {want}"


def same_history(project: Path, reference: str, victim: str, sub: str, tag: str) -> None:
    """The victim's TensorBoard history of `tag` (in `<run>/<sub>`) is the reference's, one
    value for each of its `HF_TOTAL` steps."""
    want = scalars(project / reference / sub, tag)
    got = scalars(project / victim / sub, tag)
    assert len(want) == HF_TOTAL, want
    assert got == want, f"{sub}/{tag}: {got} != {want}"


async def test_tensorboard_holds_the_uninterrupted_history(stack: Stack, tmp_path: Path) -> None:
    root = tmp_path / "tb"
    victim, reference = await run_pair(
        stack, {"kind": "tensorboard", "dir": str(root), "project": "p"}, tmp_path / "marks"
    )
    runs = sorted(p.name for p in (root / "p").iterdir())
    assert runs == sorted([victim, reference]), runs  # one log dir per Baton run
    tracked_history_is_the_references(root / "p", reference, victim)


async def test_mlflow_holds_one_run_with_the_uninterrupted_history(
    stack: Stack, tmp_path: Path
) -> None:
    from tests.support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "mlflow")
    try:
        tracking = {"kind": "mlflow", "uri": server.uri, "project": "tracked"}
        victim, reference = await run_pair(stack, tracking, tmp_path / "marks")
        runs, points = mlflow_loss(server.uri, "tracked", [victim, reference])
        assert [s for s, _ in points[reference]] == list(range(TOTAL)), points[reference]
        assert points[victim] == points[reference], points
        assert {runs[r].info.status for r in (victim, reference)} == {"FINISHED"}
    finally:
        server.close()


def mlflow_loss(
    uri: str, experiment: str, run_ids: list[str]
) -> tuple[dict[str, Any], dict[str, list[tuple[int, float]]]]:
    """The MLflow runs of `experiment`, one for each of `run_ids` (by their `baton.run_id`
    tag), and each one's `loss` history, (step, value) by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    runs = {r.data.tags.get("baton.run_id"): r for r in client.search_runs(
        [found.experiment_id])}  # fmt: skip
    assert sorted(runs) == sorted(run_ids), sorted(runs)  # one tracker run per Baton run
    points = {
        run_id: sorted((m.step, m.value) for m in client.get_metric_history(
            runs[run_id].info.run_id, "loss"))
        for run_id in run_ids
    }  # fmt: skip
    return runs, points


def wandb_history(root: Path, run_id: str, metric: str) -> list[tuple[int, float]]:
    """The (step, value) rows of `metric` W&B's offline files under `root` hold for the
    Baton run's W&B run, every process's folder of it, in the order written."""
    from baton.tracking import identity, wandb_files

    rows = wandb_files.history(root / "wandb", identity.wandb_id(run_id))
    return [(step, values[metric]) for step, values in rows if metric in values]


async def test_wandb_holds_one_run_with_the_uninterrupted_history(
    stack: Stack, tmp_path: Path
) -> None:
    """W&B offline, read back from its own files: each attempt's process leaves a folder of
    the one W&B run (the run id's), and together they hold each step's loss once, the
    uninterrupted run's — though W&B loses what a killed process logged since its file's
    last block (Baton keeps such rows in its checkpoints until the file holds them)."""
    from baton.tracking import identity, wandb_files

    root = tmp_path / "wb"
    tracking = {"kind": "wandb", "mode": "offline", "dir": str(root), "project": "tracked"}
    victim, reference = await run_pair(stack, tracking, tmp_path / "marks")
    want = wandb_history(root, reference, "loss")
    assert [s for s, _ in want] == list(range(TOTAL)), want
    got = wandb_history(root, victim, "loss")
    assert got == want, f"{got} != {want}"
    parts = wandb_files.folders(root / "wandb", identity.wandb_id(victim))
    assert len(parts) >= 3, parts  # one W&B run, a folder for each attempt's process


async def test_the_hf_trainers_wandb_callback_resumes_the_one_run(
    stack: Stack, tmp_path: Path
) -> None:
    """The Trainer with `report_to = ["wandb"]` under `[tracking] wandb` (offline), killed
    twice: its W&B callback (the arguments, as the run's config) and Baton's rows (the
    Trainer's logs, under its global steps) land in the one W&B run, `loss` once per step
    with the values of the same job run without a kill."""
    from baton.tracking import identity, wandb_files

    root = tmp_path / "wb"
    tracking = {"kind": "wandb", "mode": "offline", "dir": str(root), "project": "hf"}
    lm = hf_tracked(tracking, "wandb")
    reference, victim = await killed_twice(stack, lm, tmp_path / "marks")
    want = wandb_history(root, reference, "loss")
    assert [s for s, _ in want] == list(range(1, HF_TOTAL + 1)), want  # its global steps
    assert wandb_history(root, victim, "loss") == want
    configured = [
        folder
        for folder in wandb_files.folders(root / "wandb", identity.wandb_id(victim))
        if "learning_rate" in wandb_files.config(folder, identity.wandb_id(victim))
    ]
    assert configured, "the callback logged no arguments"


async def test_the_hf_trainers_tensorboard_resumes_its_run(stack: Stack, tmp_path: Path) -> None:
    """The Trainer with `report_to = ["tensorboard"]` under `[tracking] tensorboard`,
    killed twice: the Trainer's own TensorBoard callback (a writer on the run's log dir
    with `purge_step`) and Baton's rows each end with the history of the same job run
    without a kill."""
    root = tmp_path / "tb"
    tracking = {"kind": "tensorboard", "dir": str(root), "project": "hf"}
    lm = hf_tracked(tracking, "tensorboard")
    reference, victim = await killed_twice(stack, lm, tmp_path / "marks")
    for tag, sub in (("train/loss", ""), ("loss", "baton")):
        same_history(root / "hf", reference, victim, sub, tag)


async def test_the_hf_trainers_mlflow_callback_resumes_the_one_run(
    stack: Stack, tmp_path: Path
) -> None:
    """The Trainer with `report_to = ["mlflow"]` under `[tracking] mlflow`, killed twice:
    its MLflow callback (which reads `MLFLOW_RUN_ID`: the arguments, as params) and Baton's
    rows (the Trainer's logs, under its global steps) land in one MLflow run, `loss` once
    per step with the values of the same job run without a kill."""

    from tests.support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "mlflow")
    try:
        tracking = {"kind": "mlflow", "uri": server.uri, "project": "hf"}
        lm = hf_tracked(tracking, "mlflow")
        reference, victim = await killed_twice(stack, lm, tmp_path / "marks")
        runs, points = mlflow_loss(server.uri, "hf", [reference, victim])
        steps = [s for s, _ in points[reference]]
        assert steps == list(range(1, HF_TOTAL + 1)), steps  # the Trainer's global steps
        assert points[victim] == points[reference], points
        assert runs[victim].data.params, "the callback logged no arguments"
    finally:
        server.close()


async def test_lightnings_logger_resumes_its_run(stack: Stack, tmp_path: Path) -> None:
    """A `LightningModule` that logs through Lightning's default logger (`logger=True`)
    under `[tracking] tensorboard`, killed twice: the logger Baton puts in place writes the
    run's log dir with `purge_step`, and ends — as Baton's rows do — with the history of
    the same job run without a kill."""
    root = tmp_path / "tb"
    tracking = {"kind": "tensorboard", "dir": str(root), "project": "pl"}
    reference, victim = await killed_twice(stack, pl_tracked(tracking), tmp_path / "marks")
    for tag, sub in (("loss", "lightning"), ("loss", "baton")):
        same_history(root / "pl", reference, victim, sub, tag)


async def test_lightnings_logger_on_wandb_and_mlflow_resumes_the_one_run(
    stack: Stack, tmp_path: Path
) -> None:
    """The Lightning example with its default logger under `[tracking]` W&B (offline) and
    then MLflow, killed twice each time: the logger Baton
    puts in place (`BatonCallback.logger()`) logs the module's hyperparameters to the run's
    one tracker run, and the metrics reach it through Baton's rows, `loss` once per step
    with the values of the same job run without a kill."""

    from baton.tracking import identity, wandb_files
    from tests.support.mlflow_server import MlflowServer

    root = tmp_path / "wb"
    lm = pl_tracked({"kind": "wandb", "mode": "offline", "dir": str(root), "project": "pl"})
    reference, victim = await killed_twice(stack, lm, tmp_path / "marks-wandb")
    want = wandb_history(root, reference, "loss")
    assert len(want) == HF_TOTAL, want
    assert wandb_history(root, victim, "loss") == want
    folders = wandb_files.folders(root / "wandb", identity.wandb_id(victim))
    assert any("batch" in wandb_files.config(f, identity.wandb_id(victim)) for f in folders)

    server = MlflowServer(tmp_path / "mlflow")
    try:
        lm = pl_tracked({"kind": "mlflow", "uri": server.uri, "project": "pl"})
        reference, victim = await killed_twice(stack, lm, tmp_path / "marks-mlflow")
        runs, points = mlflow_loss(server.uri, "pl", [reference, victim])
        assert len(points[reference]) == HF_TOTAL, points[reference]
        assert points[victim] == points[reference], points
        assert "batch" in runs[victim].data.params, runs[victim].data.params
        assert runs[victim].info.status == "FINISHED"
    finally:
        server.close()


async def test_tensorboard_holds_the_uninterrupted_history_through_a_preemption(
    stack: Stack, tmp_path: Path
) -> None:
    """The tracked job is preempted by a run of higher priority that needs both trainers
    (it checkpoints and gives its trainer up, losing no step), then resumes and completes:
    TensorBoard holds one run whose histories, Baton's and the user's writer's, are the
    uninterrupted run's."""
    root = tmp_path / "tb"
    tracking = {"kind": "tensorboard", "dir": str(root), "project": "pre"}
    nc = await stack.client()
    reference = await submit(nc, tracked(tracking, None))
    assert (await finished(nc, reference, timeout=240)).state is RunState.COMPLETED
    victim = await submit(
        nc, msgspec.structs.replace(tracked(tracking, None), config={"pace": 0.3})
    )
    log = EventLog(nc, victim)
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted) and e.step >= 10, 60, "10")
    urgent = await submit(nc, job(
        name="urgent", entry_point="examples.ddp:train", total_steps=20, ranks=2, seed=11,
        priority=10, checkpoint={"every_steps": 10}, idempotency_key=uuid.uuid4().hex,
    ))  # fmt: skip
    preempted = await log.wait_for(lambda e: isinstance(e, Preempted), 60, "the preemption")
    assert isinstance(preempted, Preempted) and preempted.by == urgent, preempted
    assert (await finished(nc, urgent, timeout=240)).state is RunState.COMPLETED
    assert (await finished(nc, victim, timeout=240)).state is RunState.COMPLETED
    assert len(log.of(Started)) == 2, "one attempt before the preemption, one after"
    log.close()
    tracked_history_is_the_references(root / "pre", reference, victim)


async def test_tensorboard_holds_the_uninterrupted_history_through_a_site_cut(
    tmp_path: Path,
) -> None:
    """The tracked job and its reference, both granted to the site lab1 (one trainer), which
    is then cut off from the hub: at the cut-off site the reference trains through and the
    victim kills its own training process twice (between checkpoints, and in the step
    before one), each time resumed there from the site's last commit (the site's
    checkpointer's, its events waiting in the site's outbox for the hub). At heal both are
    COMPLETED at the hub, and TensorBoard holds one run each whose histories, Baton's rows
    and the user's writer's, are equal."""
    from tests.support.sites import Site

    root = tmp_path / "tb"
    tracking = {"kind": "tensorboard", "dir": str(root), "project": "cut"}
    hub = Stack(tmp_path / "hub", trainers=0, lease_ttl=6)
    await hub.start(("dispatcher", "checkpointer", "reaper"))
    try:
        site = Site(hub, "lab1")
        await site.start(trainers=1)
        nc = await hub.client()
        runs = await Runs.open(nc.jetstream())
        # Slow enough that the cut comes while the first still trains and the other waits
        # its turn, granted ahead.
        slow = {"pace": 0.15}
        reference = await submit(nc, msgspec.structs.replace(
            tracked(tracking, None), config=slow, estimate_s=30
        ))  # fmt: skip
        kills = tracked(tracking, tmp_path / "marks")
        victim = await submit(nc, msgspec.structs.replace(
            kills, config={**(kills.config or {}), **slow}, estimate_s=30
        ))  # fmt: skip

        async def both_granted() -> bool:
            found = [await runs.get(r) for r in (reference, victim)]
            return all(f is not None and f[0].site == "lab1" for f in found)

        await eventually(both_granted, 60, "both runs to be granted to lab1")
        site.proxy.sever()

        async def done_at_site() -> bool:
            subjects = [names.at_site(names.event_subject(r, "completed"), "lab1")
                        for r in (reference, victim)]  # fmt: skip
            return all([await site.outbox(s) for s in subjects])

        await eventually(done_at_site, 240, "both runs to complete at the cut-off site")
        started = await site.outbox(names.at_site(names.event_subject(victim, "started"), "lab1"))
        assert len(started) == 3, f"the victim ran {len(started)} attempts at lab1, not 3"
        site.proxy.restore()
        for run_id in (reference, victim):
            record = await finished(nc, run_id, timeout=60)
            assert record.state is RunState.COMPLETED, (run_id, record.state, record.reason)
    finally:
        await hub.stop()
    runs_there = sorted(p.name for p in (root / "cut").iterdir())
    assert runs_there == sorted([victim, reference]), runs_there  # one log dir per Baton run
    tracked_history_is_the_references(root / "cut", reference, victim)
