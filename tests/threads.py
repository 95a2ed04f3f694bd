"""Torch threads for a test process: its share of the cores among the xdist workers.

Two workers of two threads each on two cores oversubscribe them, and OpenMP's spinning barriers
then wait for a descheduled thread at every op: the in-process model tests ran several times
slower than alone. Every test that builds a model or an engine in its own process uses this
count (engines started as processes get `--num-threads` from their deployment).
"""

from __future__ import annotations

import os


def _share() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


TEST_THREADS = _share()


def engine_config(**fields):
    """An EngineConfig for an engine built inside a test process: its share of the cores."""
    from baton.engine import EngineConfig

    return EngineConfig(**{"num_threads": TEST_THREADS, **fields})
