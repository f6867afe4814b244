"""The state kept in KV buckets: run records and how a run ends (`runs`, `endings`), every
way a record may move (`transitions`), leases (`lease`), the worker registry (`workers`),
pools (`pools`), groups (`groups`), and the hub's clock (`clock`)."""
