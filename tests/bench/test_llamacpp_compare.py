"""bench/llamacpp_compare.py's summary, targets and table from canned runs (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import llamacpp_compare as lc  # noqa: E402


def run(tpot_ms: float, draft_n=None, draft_accepted=None) -> dict:
    return {"ttft_s": 0.1, "tpot_s": tpot_ms / 1e3, "tokens": 128, "text": "x",
            "draft_n": draft_n, "draft_accepted": draft_accepted}


def fixed_row(tpot: float, tok_s: float) -> dict:
    return {"tpot_p50_ms": tpot, "out_tok_s": tok_s}


def canned() -> dict:
    copy = {}
    for prompt in lc.COPY_PROMPTS:
        copy[(prompt, "Baton off")] = [run(20.0), run(22.0)]
        copy[(prompt, "Baton ngram")] = [run(12.0), run(14.0)]
        copy[(prompt, "Baton suffix")] = [run(11.0), run(13.0)]
        copy[(prompt, "llama.cpp")] = [run(15.0), run(15.0)]
        copy[(prompt, "llama.cpp ngram-simple")] = [run(14.0, 10, 4), run(14.0, 10, 6)]
    return {"copy": copy,
            "random": {("random", "Baton off"): [run(20.0)], ("random", "Baton ngram"):
                       [run(20.5)], ("random", "Baton suffix"): [run(19.0)]},
            "fixed": {("Baton off", 1): [fixed_row(14.0, 70.0)],
                      ("llama.cpp", 1): [fixed_row(14.0, 71.0)],
                      ("Baton off", 32): [fixed_row(90.0, 150.0), fixed_row(95.0, 160.0)],
                      ("llama.cpp", 32): [fixed_row(100.0, 100.0)]},
            "loads": {"copy": [2.0], "random": [2.0], "fixed": [2.0], "end": [3.0]}}


def test_summary_targets_and_table() -> None:
    s = lc.summarize(canned())
    assert s["best_baton_spec"] == "Baton suffix"
    assert s["best_llama_spec"] == "llama.cpp ngram-simple"
    t = s["targets"]
    assert t["copy: Baton best spec / Baton off (<= 0.8)"] == pytest.approx(12.0 / 21.0)
    assert t["copy: Baton best spec / llama.cpp best (<= 0.9)"] == pytest.approx(12.0 / 14.0)
    assert t["random: Baton ngram / off (<= 1.05)"] == pytest.approx(20.5 / 20.0)
    assert t["fixed c32 tok/s: Baton / llama.cpp (>= 1.5)"] == pytest.approx(1.55)
    check = {"ref_words": 4, "shared_words": {"Baton off": 4, "llama.cpp": 3}}
    table = lc.markdown(s, check)
    assert "| copy:repeat | llama.cpp ngram-simple | 14.00 (14.00-14.00) | 0.67x | 10/20 |" \
        in table
    assert "| | Baton off | 14.00 (14.00-14.00) | 155.00 (150.00-160.00) |" in table
    assert "llama.cpp 3" in table


def test_plan_and_bad_config(tmp_path: Path) -> None:
    exe = tmp_path / "llama-server"
    exe.write_text("")
    cfg = lc.CompareConfig(llama_server=str(exe), spec_types=["ngram-mod"])
    plan = lc.server_plan(cfg)
    assert list(plan) == ["Baton off", "Baton ngram", "Baton suffix", "llama.cpp",
                          "llama.cpp ngram-mod"]
    assert plan["Baton suffix"] == ("baton", ["--num-threads", str(cfg.threads),
                                              "--speculative", "suffix"])
    assert plan["llama.cpp"][1] == ["--parallel", "32", "-c", "32768"]
    with pytest.raises(ValueError, match="llama_server"):
        lc.CompareConfig(llama_server=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="spec_types"):
        lc.CompareConfig(llama_server=str(exe), spec_types=["eagle"])
    with pytest.raises(ValueError, match="repeats"):
        lc.CompareConfig(llama_server=str(exe), repeats=0)


def test_baton_only_has_the_targets_without_llama_cpp(tmp_path: Path) -> None:
    raw = canned()
    raw["copy"] = {k: v for k, v in raw["copy"].items() if k[1].startswith("Baton")}
    raw["fixed"] = {k: v for k, v in raw["fixed"].items() if k[0] == "Baton off"}
    s = lc.summarize(raw)
    assert sorted(s["targets"]) == ["copy: Baton best spec / Baton off (<= 0.8)",
                                    "random: Baton ngram / off (<= 1.05)",
                                    "random: Baton suffix / off (<= 1.05)"]
    assert "| | Baton off |" in lc.markdown(s, {"ref_words": 1, "shared_words": {}})
    cfg = lc.CompareConfig(baton_only=True)
    assert list(lc.server_plan(cfg)) == ["Baton off", "Baton ngram", "Baton suffix"]
