"""The CLI's one error type, in a module of its own so that every command can catch it
without importing what raises it (NATS, the store)."""

from __future__ import annotations

from shared.errors import BatonError


class CliError(BatonError):
    """Something the user can fix; printed without a traceback. `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
