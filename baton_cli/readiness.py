"""Waiting for `baton up`'s children: every engine probed until it answers, the router's
/health until it is 200 and lists the engines, each wait bounded by the start-up deadline and
failing at once when the child it waits for has exited."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from baton.ops.supervisor import Child, LaunchError
from kv_transfer.auth import ClusterKeys

logger = logging.getLogger(__name__)


def engine_answers(address: str, keys: ClusterKeys | None) -> bool:
    from baton.service.client import probe_engine

    return probe_engine(address, timeout_s=0.2, keys=keys) is not None


def http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_engines_ready(children: list[Child], addresses: dict[str, str], deadline: float,
                       ready_s: dict[str, float], spawned_at: dict[str, float],
                       keys: ClusterKeys | None = None,
                       address_files: dict[str, str] | None = None) -> None:
    """Probe every engine until each answers, all together, so each one's time-to-ready
    (`ready_s`, seconds from its spawn) is its own and not the slowest one's before it. An
    engine started with --port 0 is probed once its address file names the port it bound;
    its command line then names that port, so a restart binds it again."""
    from baton.service.client import probe_engine

    waiting = [c for c in children if c.name in addresses]
    while waiting:
        if time.monotonic() >= deadline:
            raise LaunchError(f"{', '.join(c.name for c in waiting)} not ready in time")
        for child in list(waiting):
            child.check_alive()
            if not addresses[child.name]:
                address = _read_address((address_files or {}).get(child.name, ""))
                if not address:
                    continue
                addresses[child.name] = address
                child.pin_port(address.rsplit(":", 1)[1])
            if probe_engine(addresses[child.name], timeout_s=0.5, keys=keys) is not None:
                ready_s[child.name] = time.monotonic() - spawned_at[child.name]
                logger.info("%s ready in %.1f s", child.name, ready_s[child.name])
                waiting.remove(child)


def _read_address(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def wait_http_ready(url: str, deadline: float, child: Child,
                    accept: Callable[[dict], bool] | None = None) -> None:
    """Until `url` answers 200 (and `accept` takes its JSON body, where given)."""
    import urllib.request

    while time.monotonic() < deadline:
        child.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200 and (accept is None or accept(json.load(resp))):
                    return
        except (OSError, ValueError):  # not up yet, or not JSON yet
            pass
        time.sleep(0.1)
    raise LaunchError(f"{child.name} at {url} not ready in time")
