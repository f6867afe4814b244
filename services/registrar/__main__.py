"""`python -m services.registrar` — admit joined machines, each as itself (docs/machines.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nats.aio.client import Client

from services.registrar.service import Registrar
from services.registrar.site import SiteRegistrar
from shared.bus import service
from shared.bus.service import Service
from shared.config import Settings
from shared.credentials import read_env_file


def main() -> None:
    """Its keys from the files `baton up --machines` names: `BATON_CALLOUT_SEED_FILE` (the
    callout's signing key), `BATON_SYSTEM_AUTH_FILE` (the system account's user) and
    `BATON_PEOPLE_DIR` (the stack's people)."""
    try:
        seed = Path(os.environ["BATON_CALLOUT_SEED_FILE"]).read_bytes().strip()
        system = read_env_file(Path(os.environ["BATON_SYSTEM_AUTH_FILE"]))
    except (KeyError, OSError, ValueError) as exc:
        print(f"error: the registrar needs its keys: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    people = Path(os.environ["BATON_PEOPLE_DIR"]) if os.environ.get("BATON_PEOPLE_DIR") else None

    def make(nc: Client, s: Settings, _signals: object) -> Service:
        if s.site:  # a site's leaf node asks its own (services/registrar/site.py)
            return SiteRegistrar(nc, s, seed, system)
        return Registrar(nc, s, seed, system, people)

    service.main("registrar", make)


if __name__ == "__main__":
    main()
