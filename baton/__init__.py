"""Baton: PyTorch training that survives dropped links, killed processes and preemption.

User code needs one name from here, `RunContext` (and `Batches`, the type its
`data_loader()` returns). Code that drives Baton from Python uses `Client` (or
`AsyncClient`; docs/python.md) and the errors it raises, `CliError` and its kinds. All are
imported lazily: the CLI starts without torch, and a training process without NATS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from baton.version import __version__

__all__ = [
    "AsyncClient",
    "Batches",
    "CliError",
    "Client",
    "InvalidSpec",
    "RunContext",
    "SubmissionRejected",
    "WaitTimedOut",
    "__version__",
]

_CLIENT = {
    "Client": "baton.client.blocking",
    "AsyncClient": "baton.client.api",
    "CliError": "baton.client.errors",
    "InvalidSpec": "baton.client.errors",
    "SubmissionRejected": "baton.client.errors",
    "WaitTimedOut": "baton.client.errors",
}

if TYPE_CHECKING:
    from baton.client.api import AsyncClient
    from baton.client.blocking import Client
    from baton.client.errors import CliError, InvalidSpec, SubmissionRejected, WaitTimedOut
    from baton.runtime.context import RunContext
    from baton.runtime.data import Batches


def __getattr__(name: str) -> Any:
    if name == "RunContext":
        from baton.runtime.context import RunContext

        return RunContext
    if name == "Batches":
        from baton.runtime.data import Batches

        return Batches
    if name in _CLIENT:
        import importlib

        return getattr(importlib.import_module(_CLIENT[name]), name)
    raise AttributeError(name)
