"""Sharing a pool among people: the queue's order, priorities that preempt, fair shares,
quotas (docs/scheduling.md). Pure decisions over what the scheduler knows (`model`), taken
in one pass (`plan`), with who makes room decided by `victims` and shares by `shares`."""
