"""The soak (bench/soak.py), short: `baton up` (1 prompt + 2 completion engines, the exact mode)
under its mixed load (greedy, seeded, n=2, json_schema, long prompts, aborts, disconnects) for
70 s with a completion engine SIGKILLed every 25 s: no request lost or wrong, nothing but the
victims died, every pool whole at the end, and no growth in RSS, fds or threads of the
processes that lived through it. The 30-minute run is the same script with --duration 1800.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak  # noqa: E402 - bench/soak.py, a script, not a package

pytestmark = pytest.mark.slow


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    code = soak.main(["--duration", "70", "--kill-every", "25", "--sample-every", "2",
                      "--warmup", "15", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, result["problems"]
    assert len(result["kills"]) >= 2, result["kills"]
    kinds = {o["spec"].split("-")[0] for o in result["outcomes"]}
    assert kinds >= {"greedy", "seeded", "n2", "json", "long", "abort", "disconnect"}, kinds
    assert result["requests"].get("aborted", 0) > 0
    assert (tmp_path / "soak.png").stat().st_size > 0
