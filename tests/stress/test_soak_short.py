"""The soak (bench/soak.py), short: `baton up` (1 prompt + 2 completion engines, the exact mode)
under its mixed load (greedy, seeded, n=2, json_schema, long prompts, aborts, disconnects) for
60 s with a completion engine SIGKILLed every 20 s (at least 2 kills: the load runs on until
they are done): no request lost or wrong, nothing but the victims died, every pool whole at the
end, and no growth in RSS, fds or threads of the processes that lived through it (the router,
the prompt engine, the launcher). The long run is the same script (README, Surviving failures).
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
    code = soak.main(["--duration", "60", "--kill-every", "20", "--min-kills", "2",
                      "--sample-every", "2", "--warmup", "10", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, result["problems"]
    assert len(result["kills"]) >= 2, result["kills"]
    assert result["requests"].get("exact", 0) > 0 and result["requests"].get("aborted", 0) > 0
    assert result["recoveries"].get("migrations_completion", 0) >= 1, result["recoveries"]
    judged = {r["name"] for r in result["trends"] if r["rss_slope_mib_min"] is not None}
    assert {"router", "prompt-0"} <= judged, result["trends"]
    assert (tmp_path / "soak.png").stat().st_size > 0
