"""The serving benchmark's workloads: seeded, and shaped as their flags say."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from serve_bench import BenchConfig, WorkloadConfig, _payload, build_workload  # noqa: E402


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
