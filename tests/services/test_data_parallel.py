"""`baton engine --data-parallel-size 2`: two ranks, one scheduler each, voting on the step type
through a real gloo group (S33-S37). With skewed load every step still has the same type on
both ranks, and the idle rank joins the other's prefills with empty prompt steps."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.ops.ports import free_port
from baton.protocol import SamplingOptions
from baton.service.client import EngineClient
from tests.cluster import KEYS, EngineProcess, start_all, wait_whole

pytestmark = pytest.mark.slow


def test_two_ranks_skewed_load_agree_on_every_step(tmp_path):
    port, master, metrics_port = free_port(span=2), free_port(), free_port(span=2)
    rank0 = EngineProcess("engine", "dp", tmp_path, port=port, args=[
        "--num-blocks", "96", "--max-num-batched-tokens", "64",
        "--data-parallel-size", "2", "--data-parallel-master-port", str(master),
        "--metrics-port", str(metrics_port)])
    rank1_address = f"tcp://127.0.0.1:{port + 1}"
    rank1 = EngineProcess.__new__(EngineProcess)  # started by rank 0; only its address is ours
    rank1.engine_id, rank1.address, rank1.proc = "dp-dp1", rank1_address, rank0.proc
    try:
        start_all([rank0, rank1])
        opts = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
        # Rank 0 gets four prompts (one needs three 64-token chunks); rank 1 one short prompt.
        jobs = [(rank0.address, [300 + i] * n) for i, n in enumerate((150, 40, 20, 9))]
        jobs.append((rank1_address, [777] * 5))

        def run(job):
            with EngineClient(job[0], keys=KEYS) as c:
                return c.generate(job[1], opts, timeout_s=120)

        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, jobs))
        assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results)
        wait_whole([rank0, rank1])
        s0, s1 = rank0.stats(), rank1.stats()
        for key in ("num_prompt_steps", "num_decode_steps"):
            assert s0.extra[key] == s1.extra[key], (key, s0.extra, s1.extra)
        # Rank 1 had one prompt and rank 0 several prefill steps: rank 1 ran empty ones.
        assert s1.extra["num_empty_prompt_steps"] >= 2
        assert s0.extra["num_prompt_steps"] >= 4
        # Each rank serves its own metrics, rank r on --metrics-port + r.
        for rank, num_requests in ((0, 4), (1, 1)):
            url = f"http://127.0.0.1:{metrics_port + rank}/metrics"
            families = text_string_to_metric_families(httpx.get(url, timeout=10).text)
            (finished,) = [s for f in families if f.name == "baton_request_success"
                           for s in f.samples if s.name.endswith("_total")]
            assert finished.labels == {"engine_id": f"dp-dp{rank}", "role": "normal",
                                       "finished_reason": "length"}
            assert finished.value == num_requests
    finally:
        rank0.stop()
