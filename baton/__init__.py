"""Baton: PyTorch training that survives dropped links, killed processes and preemption.

User code needs one name from here, `RunContext` (and `Batches`, the type its
`data_loader()` returns). They are imported lazily so that the CLI starts without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from baton.version import __version__

__all__ = ["Batches", "RunContext", "__version__"]

if TYPE_CHECKING:
    from baton.runtime.context import RunContext
    from baton.runtime.data import Batches


def __getattr__(name: str) -> Any:
    if name == "RunContext":
        from baton.runtime.context import RunContext

        return RunContext
    if name == "Batches":
        from baton.runtime.data import Batches

        return Batches
    raise AttributeError(name)
