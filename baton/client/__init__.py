"""The client layer: what Baton's CLI and its dashboard do over NATS and the store, beneath
both and separate from how either shows it. `calls` (connect, submit, records, steer),
`pull` (a checkpoint out of the store), `reader` (a stream read from a point), `inspect`
(streams, checkpoints, dead letters, logs), `scheduling` (queues, pools, credits), `rebase`
(rollbacks and forks), `at_site` (reading at a site's leaf), `patience` (a client that waits
out a hub that is starting), `errors` (the one error either shows)."""
