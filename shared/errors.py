"""Baton's one error tree.

Every failure a service can meet is one of three kinds, because JetStream offers exactly
three answers to a message (see `shared.bus.answer`):

* `TransientError` — the world is briefly wrong (a link, a store, a race we lost and can
  retry). The message is nak'ed with a delay and comes back.
* `PermanentError` — this message can never succeed (bad input, a refused commit). It is
  terminated and copied to the dead-letter stream with its reason.
* anything else that escapes is a bug; it is treated as transient so that no message is
  lost, and logged loudly.
"""

from __future__ import annotations


class BatonError(Exception):
    """Root of every error Baton raises on purpose."""


class PermanentError(BatonError):
    """Retrying cannot help; the message goes to the dead-letter stream."""


class TransientError(BatonError):
    """Retrying later may help; the message is redelivered after `delay` seconds."""

    def __init__(self, message: str, delay: float = 1.0) -> None:
        super().__init__(message)
        self.delay = delay


class ContractError(PermanentError):
    """A message does not match its contract. `path` names the offending field."""

    def __init__(self, reason: str, path: str = "$") -> None:
        super().__init__(f"{reason} (at {path})" if path != "$" else reason)
        self.reason = reason
        self.path = path


class StaleToken(PermanentError):
    """The caller's lease token is no longer the newest; its work must stop."""


class FinalCommitted(StaleToken):
    """The run's final checkpoint is committed: the store takes nothing after it, from any
    token (`shared.checkpoint.commit.check_open`)."""


class ConfigError(BatonError):
    """A setting is missing or malformed; raised at start-up, before anything runs."""


# -- object storage ------------------------------------------------------------------


class StoreError(BatonError):
    """Base of object-store failures."""


class NotFound(StoreError):
    pass


class AlreadyExists(StoreError):
    """A write-once key was already written (O_EXCL / If-None-Match refused)."""


class PreconditionFailed(StoreError):
    """A conditional write found a different version than expected (If-Match refused)."""


class StoreUnavailable(StoreError, TransientError):
    """The store did not answer; the outcome of the last write is unknown."""

    def __init__(self, message: str, delay: float = 2.0) -> None:
        TransientError.__init__(self, message, delay)


class IntegrityError(StoreError, PermanentError):
    """Stored bytes do not match their recorded size or sha256, or a file is malformed."""
