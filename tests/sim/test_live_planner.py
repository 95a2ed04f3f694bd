"""`baton up --planner apply` on mock engines: the planner reads the router's finished
requests (and what they met against the SLO), decides on the live split with the simulator,
publishes its decision (the router's `/planner` and metrics) and moves an engine between roles
in place (S41). Every request succeeds and every pool is whole afterwards. (The role change itself, on real engines with
exact text, is tests/router/test_path_choice_e2e.py.)"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from baton.service.client import probe_engine
from baton.workload.words import WORDS
from tests.cluster import KEYS, is_whole
from tests.sim.test_mock_engines import PROFILE, _start

pytestmark = pytest.mark.slow


def _long_request(port: int, i: int) -> int:
    words = " ".join(WORDS[(i * 13 + j) % len(WORDS)] for j in range(700))
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "prompt": words, "max_tokens": 4, "temperature": 0})
    return resp.status_code


def test_the_planner_moves_a_completion_engine_to_the_prompt_role():
    up = _start(["--prompt-engines", "1", "--completion-engines", "2", "--planner", "apply",
                 "--planner-profile", PROFILE, "--goodput", "ttft:1500", "tpot:200",
                 "--planner-interval", "1", "--planner-window", "20",
                 "--planner-cooldown", "600", "--planner-min-requests", "4"])
    port = up.port
    try:
        engines = up.engines
        assert len(engines) == 3, up.banner
        deadline = time.monotonic() + 120
        statuses, running, num_sent = [], [], 0
        with ThreadPoolExecutor(4) as pool:  # four long prompts in flight until it moves
            while time.monotonic() < deadline:
                statuses += [f.result() for f in running if f.done()]
                running = [f for f in running if not f.done()]
                for _ in range(4 - len(running)):
                    running.append(pool.submit(_long_request, port, num_sent))
                    num_sent += 1
                roles = [probe_engine(a, 5.0, keys=KEYS).role for a in engines.values()]
                if roles.count("prompt") >= 2:
                    break
                time.sleep(0.1)
            statuses += [f.result() for f in running]
        plan = httpx.get(f"http://127.0.0.1:{port}/planner").json()
        assert roles.count("prompt") >= 2, (plan, up.tail(30))
        assert set(statuses) == {200}, statuses
        assert plan["plan"]["recommended"]["prompt"] >= 2
        # what the requests met reached the planner: the router's outcomes (TTFT, TPOT)
        observed = httpx.get(f"http://127.0.0.1:{port}/planner/observations",
                             params={"window_s": 600}).json()["outcomes"]
        assert len(observed) >= len(statuses) and all(o[3] == 1 and o[1] > 0 for o in observed)
        assert plan["plan"]["slo"].endswith("ms)"), plan
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'baton_router_planner_recommended_engines{role="prompt"}' in metrics
        assert _long_request(port, 99) == 200  # the new fleet serves
        deadline = time.monotonic() + 30
        while not all(is_whole(probe_engine(a, 5.0, keys=KEYS)) for a in engines.values()):
            assert time.monotonic() < deadline, "pools not whole"
            time.sleep(0.2)
    finally:
        up.stop()
