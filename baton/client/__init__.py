"""The client layer: what Baton's CLI, its dashboard and its Python API do over NATS and the
store, beneath them and separate from how each shows it. `connection` (where and as whom),
`calls` (connect, submit, records, steer), `watching` (a run to its end), `steering` (a
pause or resume, waited for), `api` and `blocking` (the Python API: `baton.AsyncClient`,
`baton.Client`), `pull` (a checkpoint out of the store), `reader` (a stream read from a
point), `inspect` (streams, checkpoints, dead letters, logs), `scheduling` (queues, pools,
credits), `rebase` (rollbacks and forks), `at_site` (reading at a site's leaf), `patience`
(a client that waits out a hub that is starting), `errors` (the one error all show)."""
