"""One experiment-tracker run per Baton run, each step logged once (docs/tracking.md).

`identity` names the tracker run and builds the environment every attempt's training
process gets, so a user's own `mlflow.start_run()` / `wandb.init()` resumes that run;
`rows` buffers `ctx.report()`'s metrics per step until a committed checkpoint keeps them;
`sinks` writes kept rows to the tracker; `tracker` ties them to a `RunContext`. Nothing
here imports a tracker's client until a run that configures one needs it.
"""
