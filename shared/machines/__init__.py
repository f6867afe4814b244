"""Machines with identities of their own: join tokens, the registry of machines, and the
NATS auth callout through which the hub's servers ask who a machine is (docs/machines.md)."""
