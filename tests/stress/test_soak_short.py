"""The soak (bench/soak.py), short: `baton up` (2 prompt + 2 completion engines, the exact mode)
under its mixed load (greedy, seeded, n=2, json_schema, long prompts, aborts, disconnects) for
50 s with an engine SIGKILLed every 14 s, in the soak's order: completion-0, completion-1, then
prompt-0 (at least 3 kills: the load runs on until they are done): no request lost or wrong,
nothing but the victims died, every pool whole at the end, and no growth in RSS, fds or threads
of the processes that lived through it (the router, prompt-1, the launcher). This is also the
suite's run of tests/stress/test_chaos.py's two deployments (a killed completion engine's
requests migrate; a killed prompt engine's are retried or migrate), which run on their own with
BATON_CHAOS_SCALE > 1. The long run is the same script (README, Surviving failures).
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
    code = soak.main(["--duration", "50", "--kill-every", "14", "--min-kills", "3",
                      "--prompt-engines", "2", "--sample-every", "2", "--warmup", "10",
                      "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, result["problems"]
    victims = [k["engine"] for k in result["kills"]]
    assert victims[:3] == ["completion-0", "completion-1", "prompt-0"], result["kills"]
    assert result["requests"].get("exact", 0) > 0 and result["requests"].get("aborted", 0) > 0
    assert result["recoveries"].get("migrations_completion", 0) >= 1, result["recoveries"]
    judged = {r["name"] for r in result["trends"] if r["rss_slope_mib_min"] is not None}
    assert {"router", "prompt-1"} <= judged, result["trends"]
    assert (tmp_path / "soak.png").stat().st_size > 0
