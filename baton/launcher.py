"""`baton up`: start every Baton service on this host.

Until the engine services exist this runs an offline demo of what does exist.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start Baton on this host")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from baton import _scheduler

    print(f"Baton: compiled scheduler loaded ({_scheduler.__name__}); services not built yet.")
    return 0
