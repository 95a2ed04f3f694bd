"""`baton profile`'s serving-path measurement (simulator/calibrate.py): lone requests through
`baton up --mock` (the real router, engine loop, ZMQ and NIXL) against the simulator's
prediction of the same requests alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from baton_cli.main import main as baton_main
from simulator.calibrate import CalibrateConfig, ProbeConfig, calibrate_path

DATA = Path(__file__).resolve().parents[1] / "data"


def test_the_path_is_measured_on_a_mock_pd_fleet():
    cfg = CalibrateConfig(shapes=("pd",), prompt_lens=(32, 256), repeats=1, max_tokens=2,
                          stream_tokens=8)
    cost, samples = calibrate_path(DATA / "profile_test.json", cfg)
    assert cost.num_requests == len(samples) == 2
    assert [(s.shape, s.prompt_tokens) for s in samples] == [("pd", 32), ("pd", 256)]
    for s in samples:
        # The prediction is the profile's prefill (a longer prompt, a longer step); what the
        # live request takes beyond it is the path, a few milliseconds here, never seconds.
        assert 0 < s.predicted_ttft_ms and 0 < s.predicted_gap_ms
        assert -50 < s.ttft_ms - s.predicted_ttft_ms < 1000
    assert samples[1].predicted_ttft_ms > samples[0].predicted_ttft_ms
    assert 0 <= cost.request_ms < 1000 and 0 <= cost.handoff_ms < 1000
    # The engine loop's own work between steps, off the mock engines' /metrics: a fraction of
    # a millisecond here, never the steps themselves (tens of ms in this profile).
    assert 0 < cost.step_gap_ms < 20 and type(cost.step_gap_ms) is float  # not numpy's
    # The router's and this client's CPU for the streams' outputs: a millisecond or so a step
    # and a token here, never nothing (the router's work per output is real), never the steps.
    assert 0 < cost.service_step_ms + cost.service_token_ms < 20


@pytest.mark.parametrize("kw, field", [({"shapes": ("both",)}, "shapes"),
                                       ({"prompt_lens": (4096,)}, "prompt_lens"),
                                       ({"max_tokens": 1}, "max_tokens"),
                                       ({"stream_counts": (2, 2)}, "stream_counts"),
                                       ({"stream_tokens": 1}, "stream_tokens")])
def test_bad_settings_are_named(kw, field):
    with pytest.raises(ValueError, match=field):
        CalibrateConfig(**kw)


def test_a_probe_without_a_second_token_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        ProbeConfig(lone_max_tokens=1)  # a streamed request's timing needs two chunks
    with pytest.raises(ValueError, match="max_tokens"):
        ProbeConfig(solo_max_tokens=1)
    with pytest.raises(ValueError, match="burst"):
        ProbeConfig(burst=1)  # one stream in the burst: the solo phase again, no third equation


def test_path_only_needs_a_readable_profile(tmp_path, capsys):
    assert baton_main(["profile", "--out", str(tmp_path / "none.json"), "--router-only"]) == 2
    assert "none.json" in capsys.readouterr().err
    shutil.copy(DATA / "profile_test.json", tmp_path / "p.json")
    with pytest.raises(SystemExit):  # one or the other
        baton_main(["profile", "--out", str(tmp_path / "p.json"), "--router-only", "--no-path"])
    # The engine's flags mean nothing without an engine: refused by name, the file untouched.
    before = (tmp_path / "p.json").read_text()
    for flag, value in (("--threads", "2"), ("--quantization", "int8")):
        assert baton_main(["profile", "--out", str(tmp_path / "p.json"), "--router-only",
                           flag, value]) == 2
        assert flag in capsys.readouterr().err
    assert (tmp_path / "p.json").read_text() == before


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux schedstat only")
def test_schedstat_reads_each_thread_and_their_sum():
    """The service's CPU (and bench/service_steal.py's loop thread) from Linux schedstat: this
    process's threads each (this one among them, having run), their sum the process's; a
    process that is gone reads as none."""
    import os
    import threading

    import numpy as np

    from simulator.calibrate import schedstat_ms, thread_schedstat_ms

    sum(range(200_000))  # some time on a core
    threads = thread_schedstat_ms(os.getpid())
    assert threading.get_native_id() in threads
    assert threads[threading.get_native_id()][0] > 0
    total = schedstat_ms(os.getpid())
    assert total is not None and total[0] >= sum(t[0] for t in threads.values()) - 1e-6
    assert np.all(total >= 0)
    assert thread_schedstat_ms(2**22 + 1) == {} and schedstat_ms(2**22 + 1) is None
