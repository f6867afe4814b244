"""Baton: PyTorch training that survives dropped links, killed processes and preemption.

User code needs one name from here, `RunContext`. It is imported lazily so that the CLI
starts without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["RunContext", "__version__"]

if TYPE_CHECKING:
    from baton.context import RunContext


def __getattr__(name: str) -> Any:
    if name == "RunContext":
        from baton.context import RunContext

        return RunContext
    raise AttributeError(name)
