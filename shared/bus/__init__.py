"""The message bus: everything that talks to NATS on a service's behalf.

`names` (every subject, stream, consumer and bucket name), `connect` (connections and the
publish that may be retried), `streams` (declaring streams and consumers), `kvwrite` (CAS
writes that also work across a leaf's domain), `emit` (lifecycle events), `answer` (how a
handler's outcome becomes an ack, nak or dead letter), `service` (the service loop), and
`sourcing` (how the hub takes in a site's outbox).
"""
