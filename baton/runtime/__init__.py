"""What runs inside the training process: the run context user code receives (`context`),
snapshots (`snapshot`), registered state (`slots`), resumable data (`data`) and the
exactness witness (`witness`). Nothing here talks to NATS."""
