"""Where a client connects and as whom: the server, the credentials and TLS that every
`baton` command and the Python API (`baton.Client`) use, found in one order.

Invariant: the CLI and the Python API find the same server and the same credentials from
the same settings — the CLI's `Connection.options` and `baton.client.api` both call
`options` here. Imports nothing heavy: `baton --help` reaches it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DEFAULT_SERVER = "nats://127.0.0.1:4222"
"""Where `baton up` listens by default, and where a command connects without `--server`
or `NATS_URL`."""
OPERATOR_AUTH_FILE = Path(".baton") / "auth" / "operator.env"
"""The operator's credentials that `baton up` wrote next to the stack it started."""


def server_url(explicit: str | None = None) -> str:
    """`explicit` (`--server`), else `NATS_URL`, else `DEFAULT_SERVER`."""
    return explicit or os.environ.get("NATS_URL") or DEFAULT_SERVER


def options(
    creds: str | None = None,
    auth_file: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    default: Path = OPERATOR_AUTH_FILE,
) -> dict[str, Any]:
    """nats-py options: `creds` (a JWT creds file; NATS_CREDS), else `auth_file`
    (NATS_AUTH_FILE), else NATS_USER and NATS_PASSWORD, else the file that `baton up`
    wrote in ./.baton (`default`) — so a client next to a stack it started just works. TLS
    from `tls_ca` (NATS_CA) and `tls_cert`/`tls_key` (NATS_CERT/NATS_KEY). Each argument
    not given is read from its variable, as the CLI's options are."""
    import ssl

    from shared import credentials

    env = os.environ.get
    creds, auth_file = creds or env("NATS_CREDS"), auth_file or env("NATS_AUTH_FILE")
    tls_ca, tls_cert = tls_ca or env("NATS_CA"), tls_cert or env("NATS_CERT")
    tls_key = tls_key or env("NATS_KEY")
    opts: dict[str, Any] = {}
    if creds:
        opts["user_credentials"] = creds
    elif auth_file:
        opts.update(credentials.options_for(credentials.read_env_file(Path(auth_file))))
    elif not credentials.client_options() and default.is_file():
        opts.update(credentials.options_for(credentials.read_env_file(default)))
    if tls_ca or tls_cert:
        ctx = ssl.create_default_context(cafile=tls_ca)
        if tls_cert:
            ctx.load_cert_chain(tls_cert, tls_key)
        opts["tls"] = ctx
    return opts
