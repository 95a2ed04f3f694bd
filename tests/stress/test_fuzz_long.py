"""The fuzz of tests/services/test_fuzz.py, long: BATON_FUZZ_LONG_SECONDS per endpoint, with
other seeds; skipped unless it is set. Run: BATON_FUZZ_LONG_SECONDS=600 .venv/bin/python -m
pytest -q tests/stress/test_fuzz_long.py
"""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.cluster import wait_for
from tests.services.test_fuzz import (
    LEASE_TTL_S,
    _is_idle,
    fuzz_engine_socket,
    fuzz_router_side,
    fuzz_side_channel,
    prompt_engine,  # noqa: F401 (the module's engine fixture)
)

SECONDS = float(os.environ.get("BATON_FUZZ_LONG_SECONDS", "0"))
# The short fuzz (tests/services/test_fuzz.py) runs in every suite; this one only when asked.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SECONDS <= 0, reason="long fuzz: set BATON_FUZZ_LONG_SECONDS "
                                 "(e.g. 600) to run it")]


def test_engine_endpoints_survive_a_long_fuzz(prompt_engine):  # noqa: F811
    assert fuzz_engine_socket(prompt_engine, SECONDS, seed=11) > 0
    assert fuzz_side_channel(prompt_engine, SECONDS, seed=12) > 0
    wait_for(lambda: _is_idle(prompt_engine.stats()), timeout_s=LEASE_TTL_S + 30, poll_s=0.2)


def test_router_side_survives_a_long_fuzz():
    assert asyncio.run(fuzz_router_side(SECONDS, seed=13)) > 0
