"""The state kept in KV buckets: run records and how a run ends (`runs`, `endings`), leases
(`lease`), the worker registry (`workers`) and pools (`pools`)."""
