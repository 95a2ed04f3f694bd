"""Mooncake trace replay: scaling, equal hash ids give equal token blocks, bad lines named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.workload.trace import TraceConfig, TraceError, build_trace_workload, read_records
from baton.workload.words import WordTokenizer

WINDOW = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_window.jsonl"


def test_window_replays_with_scaled_lengths_and_times():
    recs = read_records(TraceConfig(str(WINDOW), num_requests=50))
    specs = build_trace_workload(TraceConfig(str(WINDOW), num_requests=50, time_scale=2.0,
                                             length_scale=0.125))
    assert len(specs) == 50
    for rec, spec in zip(recs, specs, strict=True):
        assert spec.num_prompt_words == len(spec.prompt.split()) == round(rec.input_length / 8)
        assert spec.max_tokens == max(1, round(rec.output_length / 8))
        assert spec.arrival_s == pytest.approx(rec.timestamp_ms / 1e3 * 2.0)


def test_equal_hash_ids_give_equal_token_blocks():
    cfg = TraceConfig(str(WINDOW), num_requests=200, length_scale=0.0625)  # 32-token blocks
    recs, specs = read_records(cfg), build_trace_workload(cfg)
    tok = WordTokenizer(49152)
    seen: dict[int, list[int]] = {}
    checked = 0
    for rec, spec in zip(recs, specs, strict=True):
        ids = tok.encode(spec.prompt)
        for i, h in enumerate(rec.hash_ids):
            block = ids[32 * i: 32 * (i + 1)]
            if len(block) < 32:
                continue
            if h in seen:
                assert seen[h] == block
                checked += 1
            seen[h] = block
    assert checked > 50  # the window reuses prefixes (conversations)
    assert len({tuple(b) for b in seen.values()}) == len(seen)  # distinct ids: distinct blocks


@pytest.mark.parametrize("line, words", [
    ("{not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "missing field 'hash_ids'"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}', "2 ids"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 2, "hash_ids": ["a"]}', "hash_ids"),
    ('[1, 2]', "JSON object"),
])
def test_a_malformed_line_is_refused_naming_it(tmp_path, line, words):
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]})
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{words}"):
        read_records(TraceConfig(str(path)))


def test_scales_must_be_positive():
    with pytest.raises(ValueError, match="time_scale"):
        TraceConfig(str(WINDOW), time_scale=0)


def test_spread_bursts_spreads_each_timestamp_over_the_gap_to_the_next():
    """Mooncake's timestamps are 3 s bins: spread, a bin's requests arrive evenly across it,
    in file order; the last bin over the median gap; the prompts are the same."""
    from baton.workload.trace import spread_bursts

    assert spread_bursts([0, 0, 0, 3000, 5999, 5999]) == [0, 1000, 2000, 3000, 5999, 7499]
    assert spread_bursts([7.0, 7.0]) == [7.0, 7.0]  # one timestamp: nothing to spread over
    kept = build_trace_workload(TraceConfig(str(WINDOW), num_requests=40, time_scale=0.5))
    spread = build_trace_workload(TraceConfig(str(WINDOW), num_requests=40, time_scale=0.5,
                                              spread_bursts=True))
    assert [s.prompt for s in spread] == [s.prompt for s in kept]
    assert len({s.arrival_s for s in kept}) < 10 and len({s.arrival_s for s in spread}) == 40
    arrivals = [s.arrival_s for s in spread]
    assert arrivals == sorted(arrivals) and arrivals[:2] == [0.0, 0.15]  # 10 in the first 1.5 s


def test_spread_bursts_is_a_trace_flag(tmp_path, capsys):
    from baton_cli.main import main as baton_main

    profile = str(Path(__file__).resolve().parents[1] / "data" / "profile_test.json")
    assert baton_main(["sim", "--profile", profile, "--spread-bursts", "--num-requests", "4",
                       "--results-dir", str(tmp_path)]) == 2
    assert "--spread-bursts" in capsys.readouterr().err
    assert baton_main(["sim", "--profile", profile, "--trace", str(WINDOW), "--spread-bursts",
                       "--num-requests", "12", "--length-scale", "0.03",
                       "--results-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["workload"]["spread_bursts"] is True
