"""The serving benchmark's workloads: seeded, and shaped as their flags say."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from serve_bench import (  # noqa: E402
    BenchConfig,
    RequestSpec,
    WorkloadConfig,
    _payload,
    build_workload,
    send_request,
)


def test_multi_turn_conversations_share_one_system_prompt() -> None:
    cfg = WorkloadConfig(dataset="multi-turn", turns=3, system_prompt_len=20, seed=5)
    specs = build_workload(cfg, 4)
    assert [(s.conversation, s.turn) for s in specs] == [(c, t) for c in range(4) for t in range(3)]
    assert len({s.system for s in specs}) == 1 and len(specs[0].system.split()) == 20
    assert build_workload(cfg, 4) == specs  # seeded
    history = [{"role": "user", "content": specs[0].prompt},
               {"role": "assistant", "content": "an answer"}]
    body = _payload(BenchConfig(), specs[1], "m", True, history)
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][-1]["content"] == specs[1].prompt


def test_shared_prefix_draws_from_a_few_system_prompts() -> None:
    cfg = WorkloadConfig(dataset="shared-prefix", num_system_prompts=2, system_prompt_len=8)
    specs = build_workload(cfg, 30)
    assert len({s.system for s in specs}) == 2
    assert all(s.conversation == -1 for s in specs)
    body = _payload(BenchConfig(endpoint="completions"), specs[0], "m", False)
    assert body["prompt"].startswith(specs[0].system) and body["prompt"].endswith(specs[0].prompt)


def test_structured_fraction_marks_requests_without_changing_the_prompts() -> None:
    """--structured-fraction draws which requests ask for JSON-schema output from its own random
    stream (same prompts and lengths as without), and those carry OpenAI's response_format."""
    import pytest

    from baton.workload.args import build_specs
    from baton.workload.synthetic import STRUCTURED_SCHEMA

    plain = build_specs(WorkloadConfig(seed=4), None, 200)
    marked = build_specs(WorkloadConfig(seed=4, structured_fraction=0.25), None, 200)
    assert [(s.prompt, s.max_tokens) for s in marked] == [(s.prompt, s.max_tokens) for s in plain]
    assert not any(s.structured for s in plain) and 30 <= sum(s.structured for s in marked) <= 70
    one = next(s for s in marked if s.structured)
    assert _payload(BenchConfig(), one, "m", True)["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "items", "schema": STRUCTURED_SCHEMA}}
    assert "response_format" not in _payload(BenchConfig(), plain[0], "m", True)
    with pytest.raises(ValueError, match="structured_fraction"):
        WorkloadConfig(structured_fraction=1.5)


def _served(chunks: list[dict]):
    """One request through the client, answered by this SSE body (the client's rules only; the
    whole path, a real router and mock engine: tests/sim/test_mock_engines.py)."""
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def ask():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            return await send_request(client, BenchConfig(endpoint="completions"),
                                      RequestSpec(0, "short", "time", 1, 1), "m", True, 0.0)
    return asyncio.run(ask())


def test_a_finished_stream_without_text_is_complete_and_a_cut_one_is_not() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    done = _served([{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, usage])
    assert done.ok and done.output_tokens == 1 and done.text == "" and done.ttft_s > 0
    cut = _served([{"choices": [{"index": 0, "text": " word", "finish_reason": None}]}])
    assert not cut.ok and "before its finish_reason" in cut.error
