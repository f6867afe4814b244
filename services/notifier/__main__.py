"""`python -m services.notifier` — tell people, through webhooks, when a run needs them.

`python -m services.notifier --check FILE` only reads the alerts file and says what is wrong
with it (`baton up --alerts FILE` asks this before it starts anything).
"""

from __future__ import annotations

import sys

from services.notifier import config
from shared.errors import ConfigError


def check(path: str) -> int:
    try:
        alerts = config.load(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"alerts file {path}: {alerts.count} receiver(s)")
    return 0


def main() -> None:
    if sys.argv[1:2] == ["--check"] and len(sys.argv) == 3:
        raise SystemExit(check(sys.argv[2]))
    from services.notifier.service import Notifier
    from shared import config as settings
    from shared.bus import service

    # The alerts file is read before anything connects: a bad one stops the notifier here,
    # naming the key, with nothing started.
    try:
        alerts = config.load(settings.load().alerts_file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    service.main("notifier", lambda nc, s, _signals: Notifier(nc, s, alerts))


if __name__ == "__main__":
    main()
