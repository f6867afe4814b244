"""deploy/slurm/baton.sbatch: a Slurm allocation as a Baton machine (docs/slurm.md).

No slurmctld or slurmd runs here (nor in CI), so the test does what Slurm documents doing
to a batch job: it runs the script with bash in a process group of its own, under the
environment Slurm gives a batch job (`SLURM_JOB_ID`, `SLURM_JOB_NAME`, …), and ends the
allocation as Slurm does — `--signal=B:TERM@N` sends SIGTERM to the batch shell alone N
seconds before the time limit; at the limit whatever is left of the job is killed (SIGTERM,
then SIGKILL KillWait seconds later; here SIGKILL to the whole process group at once, the
harsher of the two).

The allocation joins a hub with a token and trains a run; as the allocation ends the run is
checkpointed at the step it reached and handed over: a hub trainer resumes it at that very
step, and it ends with the uninterrupted run's weights. The script exits 0 before anything
is killed, and leaves no training process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from baton.stack.procs import TRAINER_GRACE_S
from shared.contracts import JobSpec, RunState
from shared.contracts.events import CheckpointCommitted, Preempted, Progress, Restored
from tests.e2e import jobs
from tests.e2e.jobs import EventLog, finished, submit
from tests.e2e.test_machines import heard_from, joined, joining_env
from tests.support.audit import Audit
from tests.support.cli import REPO, as_json
from tests.support.stack import Stack, eventually, training_processes

SCRIPT = REPO / "deploy" / "slurm" / "baton.sbatch"
HUB = ("dispatcher", "checkpointer", "reaper", "registrar")
SLURM_INSTALLED = bool(shutil.which("slurmctld") and shutil.which("slurmd"))
"""Not expected here: nothing below needs them."""


def directives() -> list[str]:
    """The script's `#SBATCH` options, as sbatch reads them: up to its first command."""
    found = []
    for line in SCRIPT.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            found.append(line.removeprefix("#SBATCH ").strip())
    return found


def signal_lead_s() -> int:
    """N of `--signal=B:TERM@N`: how long before the time limit the batch shell is told."""
    (lead,) = [
        int(m.group(1)) for d in directives() if (m := re.fullmatch(r"--signal=B:TERM@(\d+)", d))
    ]
    return lead


def slurm_env(job_id: int, name: str = "baton", **extra: str) -> dict[str, str]:
    """What Slurm sets for a batch job on one node (sbatch(1), "OUTPUT ENVIRONMENT
    VARIABLES"); the submitter's environment comes with it (`--export=ALL`)."""
    host = os.uname().nodename
    return {
        "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": name,
        "SLURM_JOB_NODELIST": host, "SLURM_NODELIST": host, "SLURMD_NODENAME": host,
        "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NTASKS": "1",
        "SLURM_CPUS_ON_NODE": "8", "SLURM_JOB_CPUS_PER_NODE": "8",
        "SLURM_JOB_PARTITION": "batch", "SLURM_CLUSTER_NAME": "test",
        "SLURM_SUBMIT_HOST": host, "SLURM_SUBMIT_DIR": str(REPO), "ENVIRONMENT": "BATCH",
        **extra,
    }  # fmt: skip


def as_sbatch(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The script run to its end as a batch job, with `BATON=echo`: the command it runs."""
    return subprocess.run(
        ["bash", str(SCRIPT)], env={"PATH": os.environ["PATH"], "BATON": "echo", **env},
        cwd=cwd, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_the_batch_shell_is_told_in_time_for_the_trainers_to_checkpoint() -> None:
    opts = directives()
    assert any(d.startswith("--time=") for d in opts), opts  # the limit the signal precedes
    # `baton join` gives its trainers TRAINER_GRACE_S to checkpoint and hand over (with
    # the default BATON_GRACE); Slurm's signal may come up to 60 s early, never late.
    assert signal_lead_s() > TRAINER_GRACE_S + 30, opts
    assert re.search(r'^exec "\$\{baton\[@\]\}" ', SCRIPT.read_text(), re.M), "no exec"
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


HUB_URL = "nats://hub:4222"


@pytest.mark.parametrize(
    ("extra", "data", "joined_before", "want"),
    [
        # A plain job's first allocation: the token; the data dir named after the job.
        ({"BATON_TOKEN": "T"}, ".baton/slurm/w-0", False, f"{HUB_URL} --token T"),
        # An array task's: its own token and data dir; the trainers asked for.
        ({"SLURM_ARRAY_TASK_ID": "3", "BATON_TOKEN": "T", "BATON_TOKEN_3": "T3",
          "BATON_TRAINERS": "2"}, ".baton/slurm/w-3", False, f"{HUB_URL} --token T3"),
        # A later allocation: the identity on disk, no token.
        ({"BATON_TOKEN": "T"}, ".baton/slurm/w-0", True, ""),
        ({"BATON_MACHINE_DIR": "{home}/m"}, "m", True, ""),
    ],
)  # fmt: skip
def test_the_command_an_allocation_runs(
    tmp_path: Path, extra: dict[str, str], data: str, joined_before: bool, want: str
) -> None:
    home = str(tmp_path)
    if joined_before:
        (tmp_path / data).mkdir(parents=True)
        (tmp_path / data / "machine.json").write_text("{}")
    env = {"HOME": home, "BATON_HUB": HUB_URL, **slurm_env(7, "w")}
    env.update({k: v.format(home=home) for k, v in extra.items()})
    done = as_sbatch(env, tmp_path)
    assert done.returncode == 0, done.stderr
    trainers = f" --trainers {extra['BATON_TRAINERS']}" if "BATON_TRAINERS" in extra else ""
    command = f"join {want + ' ' if want else ''}--data-dir {tmp_path / data}{trainers}"
    assert done.stdout.splitlines()[-1] == command, done.stdout


def test_a_first_allocation_without_a_token_says_what_it_needs(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "BATON_HUB": "nats://hub:4222", **slurm_env(8)}
    done = as_sbatch(env, tmp_path)
    assert done.returncode == 2 and "BATON_TOKEN" in done.stderr, done
    assert not (tmp_path / ".baton").exists()


def charlm(total: int, pace: float) -> JobSpec:
    return jobs.charlm(total, pace, name="charlm-slurm", seed=17, every=50)


async def end_allocation(job: asyncio.subprocess.Process, lead_s: float) -> None:
    """The allocation's end as the script asks Slurm to bring it: SIGTERM to the batch
    shell alone (the `--signal=B:TERM@lead` directive); at the time limit, `lead_s` later
    unless the job ended first, SIGKILL to whatever is left of it."""
    job.send_signal(signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(job.wait(), lead_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    await job.wait()


@pytest.mark.operations
@pytest.mark.timeout(300)
async def test_an_allocation_ending_hands_its_run_over_with_no_step_lost(tmp_path: Path) -> None:
    hub = Stack(tmp_path / "hub", trainers=0, machines=True)
    data = tmp_path / "slurm-machine"
    job: asyncio.subprocess.Process | None = None
    await hub.start(HUB)
    try:
        nc = await hub.client()
        token = (await as_json(hub, "token", "create", "--ttl", "10m"))["token"]
        env = {
            **joining_env(), **slurm_env(4242),
            "BATON_HUB": hub.nats.url, "BATON_TOKEN": token, "BATON_TRAINERS": "1",
            "BATON": f"{sys.executable} -m baton", "BATON_MACHINE_DIR": str(data),
        }  # fmt: skip
        out = (tmp_path / "baton-4242.out").open("wb")  # sbatch's --output
        job = await asyncio.create_subprocess_exec(
            "bash", str(SCRIPT), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            process_group=0,
        )  # fmt: skip
        out.close()  # the job holds its own
        _, worker = await joined(nc, data)

        reference = await submit(nc, charlm(150, pace=0.0))  # trains on the allocation
        want = (await finished(nc, reference, timeout=120)).digest
        run_id = await submit(nc, charlm(150, pace=0.1))
        log = EventLog(nc, run_id)
        await log.wait_for(
            lambda e: isinstance(e, Progress) and e.worker == worker and e.step > 5, 60,
            "the run to train on the allocation",
        )  # fmt: skip
        await hub.add_trainer("t-after")
        await heard_from(nc, "t-after", 60)

        await end_allocation(job, signal_lead_s())
        assert job.returncode == 0, (job.returncode, (tmp_path / "baton-4242.out").read_text())
        pre = await log.wait_for(
            lambda e: isinstance(e, Preempted) and e.worker == worker, 30,
            "the allocation's trainer to hand the run over",
        )  # fmt: skip
        assert isinstance(pre, Preempted) and pre.step > 5, pre
        # Checkpointed at the step it stopped at, not an earlier one.
        committed = [e.step for e in log.of(CheckpointCommitted)]
        assert pre.step in committed, (pre, committed)
        trained = max(e.step for e in log.of(Progress) if e.worker == worker)
        assert trained <= pre.step, (trained, pre)  # nothing it trained was thrown away
        back = await log.wait_for(
            lambda e: isinstance(e, Restored) and e.worker == "t-after", 60, "t-after to resume"
        )
        assert isinstance(back, Restored) and back.step == pre.step, (back, pre)
        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED and record.digest == want, record
        assert record.retries == 0, record
        assert not training_processes(data), "the allocation left training processes"
        log.close()
        Audit(data).check()
    finally:
        if job is not None and job.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            await job.wait()

        async def none_left() -> bool:
            return not training_processes(data)

        try:
            await eventually(none_left, 15, "the allocation's training processes to exit")
        finally:
            await hub.stop()
