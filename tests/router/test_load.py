"""A bounded load test: a few hundred concurrent streaming connections over loopback against a
router process whose in-flight cap is below that number. Every request completes with its
whole text or gets a 429 with Retry-After; none gets a 5xx; the router's memory stays bounded."""

from __future__ import annotations

import asyncio
import json

import httpx
import psutil

from tests.router.conftest import router_process
from tests.router.scripted_engine import ScriptedEngine

MODEL = "SmolLM2-135M-Instruct"
TEXT = " one two three four five six seven eight"
NUM_CONNECTIONS = 300
MAX_IN_FLIGHT = 64


async def _one(http: httpx.AsyncClient, i: int) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": f"Count {i}:", "max_tokens": 8, "temperature": 0,
            "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert "in flight" in response.json()["error"]["message"]
            return response.status_code, ""
        text = ""
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return 200, text


async def _round(url: str) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=NUM_CONNECTIONS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(_one(http, i) for i in range(NUM_CONNECTIONS)))


def test_hundreds_of_streams_complete_or_get_429_and_memory_stays_bounded(model_info):
    engine = ScriptedEngine("normal", model_info.tokenizer.encode(TEXT), delay_s=0.02)
    try:
        with router_process("--engine", f"normal={engine.address}",
                            "--max-concurrent-requests", str(MAX_IN_FLIGHT)) as (url, proc):
            router = psutil.Process(proc.pid)
            rounds, rss = [], [router.memory_info().rss]
            for _ in range(3):
                rounds.append(asyncio.run(_round(url)))
                rss.append(router.memory_info().rss)
            assert httpx.get(f"{url}/health").status_code == 200
    finally:
        engine.close()
    for results in rounds:
        statuses = [status for status, _ in results]
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        assert statuses.count(200) >= MAX_IN_FLIGHT and 429 in statuses
        assert all(text == TEXT for status, text in results if status == 200)
    mib = [r / 2**20 for r in rss]
    print(f"\nrouter RSS (MiB) at start and after each round of {NUM_CONNECTIONS}: "
          + ", ".join(f"{m:.1f}" for m in mib)
          + "; 200s per round: " + ", ".join(str([s for s, _ in r].count(200)) for r in rounds))
    # The first round warms caches and pools; later rounds must not keep growing.
    assert mib[-1] - mib[1] < 32, mib
