"""The CLI's one error type, in a module of its own so that every command can catch it
without importing what raises it (NATS, the store) — and how `common.run` words what NATS
raised when it could not answer, above all at a site cut off from its hub.

Invariant: a command never ends in a traceback for a JetStream that did not answer. What
it needed (`needs`) and where it asked (`SEEN`: a site's leaf, and whether the hub answered
across the link) make one line of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shared.errors import BatonError


class CliError(BatonError):
    """Something the user can fix; printed without a traceback. `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class InvalidSpec(CliError):
    """A job spec that does not validate here, before anything was published (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 2)


class SubmissionRejected(CliError):
    """The dispatcher refused a submission: `reason` and the field at `path` as its
    `rejected` event says them (exit 2). Nothing ran; no run record was kept for it."""

    def __init__(self, run_id: str, reason: str, path: str) -> None:
        super().__init__(f"rejected: {reason} (at {path})", 2)
        self.run_id, self.reason, self.path = run_id, reason, path


class WaitTimedOut(CliError, TimeoutError):
    """A run did not end within the time a caller gave it; it goes on (exit 1)."""

    def __init__(self, run_id: str, state: str, timeout: float) -> None:
        super().__init__(f"run {run_id} is still {state} after {timeout:g} s")
        self.run_id, self.state, self.timeout = run_id, state, timeout


class Seen:
    """What the command in this process found out about where it asked (set by
    `common.with_nats`, one command per process)."""

    site = ""
    """The JetStream domain of the server, when it is a site's leaf node (not the hub's)."""
    hub_up: bool | None = None
    """At a site, after a failure: whether the hub's JetStream answered across the link."""
    needs = ""
    """What the command was reading when it failed: "runs bucket", "events stream"…"""

    @classmethod
    def reset(cls) -> None:
        cls.site, cls.hub_up, cls.needs = "", None, ""


SEEN = Seen


@contextlib.contextmanager
def needs(what: str) -> Iterator[None]:
    """Name what the block reads ("runs bucket"), for the message if it fails; the
    innermost block that failed names it."""
    try:
        yield
    except Exception:
        if not SEEN.needs:
            SEEN.needs = what
        raise


def explain(exc: BaseException, command: str) -> CliError | None:
    """The one-line error for what NATS raised when JetStream could not answer; None for
    anything else."""
    from nats.errors import Error as NatsError
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import (
        BucketNotFoundError,
        NoStreamResponseError,
        NotFoundError,
        ServiceUnavailableError,
    )

    missing = (BucketNotFoundError, NotFoundError)
    silent = (ServiceUnavailableError, NoRespondersError, NoStreamResponseError, NatsTimeout)
    if not isinstance(exc, (*missing, *silent, TimeoutError)):
        if isinstance(exc, NatsError):
            return CliError(f"{command}: NATS said {type(exc).__name__}: {exc}")
        return None
    what = SEEN.needs or "JetStream"
    if SEEN.site:
        if SEEN.hub_up is False:
            return CliError(
                f"the hub is unreachable from this site (cut off?): {command} needs the "
                f"hub's {what}"
            )
        if SEEN.hub_up is None:
            return CliError(f"{command} needs the hub's {what}, which this site could not read")
        return CliError(
            f"{command} needs the hub's {what}, which site {SEEN.site}'s link does not "
            "carry for these credentials: run it against the hub"
        )
    if isinstance(exc, missing):
        return CliError(
            f"{command} needs the {what}, which does not exist on this server: no Baton "
            "service has started here yet (`baton up` starts them)"
        )
    return CliError(f"JetStream did not answer ({type(exc).__name__}): {command} needs the {what}")
