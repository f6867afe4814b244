"""Baton from Python: submit a job, watch it to the end, pull its checkpoint, and check that
the weights are bit for bit those of an uninterrupted run.

Next to a running stack (`baton up` in another terminal, in the same directory, or
NATS_URL with credentials and BATON_STORE set):

    python examples/from_python.py

The job is examples/charlm.toml, made small and slowed down (`pace` only sleeps). Part way
the run is paused — it checkpoints and its process stops, as on a machine taken away — and
resumed, by a new process, from that checkpoint. A second run of the same job, never
interrupted and not slowed down, gives the digest to compare. examples/from_python.ipynb
holds the same cells (each `# %%` below is one) for Jupyter, where this blocking client
works inside the kernel's running event loop.
"""

# %%
import tempfile
from pathlib import Path

from baton import Client
from shared.contracts.events import Completed, Paused, Progress, Started

JOB = Path("examples/charlm.toml")  # from the repository's root
SMALL = {"hidden": 64, "embed": 16, "num_workers": 0}

baton = Client()  # found as the CLI finds the stack: NATS_URL, credentials, ./.baton
print("connected to", baton.url)

# %%
run = baton.submit(JOB, steps=80, config={**SMALL, "pace": 0.1})
print("submitted", run.run_id)
paused = False
for event in run.watch():
    if isinstance(event, Progress) and event.step % 10 == 0:
        print(f"step {event.step}: loss {event.metrics.get('loss', float('nan')):.4f}")
    if isinstance(event, Progress) and event.step >= 20 and not paused:
        paused = True
        print("pausing:", run.pause("taken away part way").state.value)
    if isinstance(event, Paused):
        print("paused; resuming:", run.resume("given back").state.value)
    if isinstance(event, Started):
        print(f"started at step {event.start_step} on {event.worker}")
    if isinstance(event, Completed):
        print(f"completed at step {event.step}")
record = run.wait()
print(run.run_id, record.state.value, "after", record.attempts, "attempts")

# %%
pulled = run.pull(tempfile.mkdtemp(prefix="baton-pull-"))
print(f"pulled step {pulled.step} into {pulled.dir}: {', '.join(pulled.files)}")

# %%
reference = baton.submit(JOB, steps=80, config={**SMALL, "pace": 0.0}).wait()
print("interrupted run's weights:  ", pulled.digest)
print("uninterrupted run's weights:", reference.digest)
assert pulled.digest == record.digest == reference.digest, "resume was not exact"
print("identical: the pause and resume cost no bit")
baton.close()
