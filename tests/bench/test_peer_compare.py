"""bench/peer_compare.py's rows and table from canned serve_bench records (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import peer_compare as pc  # noqa: E402


def record(ttfts: list[float], e2e: float, out_tok_s: float) -> dict:
    reqs = [{"ok": True, "ttft_s": t, "e2e_s": e2e, "output_tokens": 11} for t in ttfts]
    reqs.append({"ok": False, "ttft_s": 0.0, "e2e_s": 0.0, "output_tokens": 0})  # left out
    return {"summary": {"num_completed": len(ttfts), "num_issued": len(ttfts) + 1,
                        "errors": {"x": 1}, "num_short_outputs": 0, "ignore_eos": True,
                        "total_prompt_tokens": 260 * len(ttfts), "cached_token_fraction": 0.0,
                        "output_throughput": out_tok_s, "duration_s": 9.0},
            "requests": reqs}


def test_rows_and_ratios_against_llama_cpp() -> None:
    llama = pc.level_row(record([0.1, 0.2, 0.3], 1.2, 50.0), pc.LLAMA, "", 8)
    baton = pc.level_row(record([0.2, 0.4, 0.6], 2.2, 100.0), "colocated", "exact", 8)
    assert llama["mode"] == "Q4_1" and baton["num_issued"] == 4
    assert baton["ttft_p50_ms"] == pytest.approx(400.0)
    assert baton["tpot_p50_ms"] == pytest.approx(180.0)  # (2.2 - 0.4) / 10 tokens
    assert baton["ttft_p10_ms"] < baton["ttft_p50_ms"] < baton["ttft_p90_ms"]
    for row in (llama, baton):
        row["load_before"], row["load_after"] = 1.0, 2.0
    prefill = {pc.LLAMA: {128: {"tok_s": 500.0, "stddev": 5.0}},
               "Baton exact": {128: {"tok_s": 250.0, "min": 240.0, "max": 260.0}}}
    table = pc.markdown_table([llama, baton], prefill)
    assert "| colocated | exact | 8 | 3/4 | 100.0 (2.00x) |" in table
    assert "| Baton exact | 250 [240-260] (0.50x) |" in table
    assert "| llama.cpp | 500 +-5 (1.00x) |" in table


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="modes"):
        pc.PeerConfig(modes=["fp8"])
    with pytest.raises(ValueError, match="num-requests"):
        pc.PeerConfig(num_requests=[1, 2])
    assert pc.PeerConfig(num_requests=[5]).num_requests == [5, 5, 5]
