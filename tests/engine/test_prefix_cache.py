"""Prefix caching in the engine (NORMAL mode): a cache hit gives exactly the tokens a cold run
gives, and skips the cached prompt tokens (block boundary, mid-block, whole prompt, after
eviction, after a reset); every block is back (free or cached-free) afterwards."""

from __future__ import annotations

import pytest
from model.reference import baton_model, prompt_of_length

from baton.engine import LLMEngine
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=8)
pytestmark = pytest.mark.slow


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": 64, "enable_prefix_caching": True,
                                      **overrides}), loaded=baton_model())


@pytest.fixture(scope="module")
def cold() -> LLMEngine:
    return make_engine(enable_prefix_caching=False)


def _run(engine: LLMEngine, prompt: list[int]):
    out = engine.generate(prompt, GREEDY)[0]
    assert engine.num_free_blocks() == engine.num_total_blocks()
    return out


def _stats(engine: LLMEngine) -> dict:
    return engine.scheduler.prefix_cache_stats()


@pytest.mark.parametrize("shared,tail", [(64, 20), (70, 9), (48, 0)],
                         ids=["block-boundary", "mid-block", "whole-prompt"])
def test_hit_equals_cold_run(cold: LLMEngine, shared: int, tail: int) -> None:
    engine = make_engine()
    base = prompt_of_length(shared + 40)
    first = base[:shared] + base[shared + 20:shared + 20 + tail] if tail else base[:shared]
    second = base[:shared] + base[shared:shared + tail] if tail else base[:shared]
    _run(engine, first)
    hits_before = _stats(engine)["hit_tokens"]
    out = _run(engine, second)
    assert out.token_ids == _run(cold, second).token_ids
    full = (shared // 16) * 16  # only full blocks are keyed
    if not tail:
        full -= 16 if shared % 16 == 0 else 0  # the last prompt token is always computed
    assert out.num_cached_tokens == full
    assert _stats(engine)["hit_tokens"] - hits_before == full


def test_output_blocks_serve_the_next_turn(cold: LLMEngine) -> None:
    """Turn 2 = turn 1's prompt + its answer + more: the answer's full blocks hit too."""
    engine = make_engine()
    turn1 = prompt_of_length(40)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    answer = engine.generate(turn1, params)[0].token_ids
    turn2 = turn1 + answer + prompt_of_length(60)[40:]
    out = _run(engine, turn2)
    assert out.num_cached_tokens == ((40 + 30 - 1) // 16) * 16  # the last token had no K/V yet
    assert out.token_ids == _run(cold, turn2).token_ids


def test_eviction_then_reset(cold: LLMEngine) -> None:
    engine = make_engine(num_blocks=24)  # 23 usable blocks
    a, b = prompt_of_length(200), prompt_of_length(300)[100:300]
    _run(engine, a)
    assert engine.scheduler.num_cached_blocks() > 0
    _run(engine, b)  # needs most of the pool: a's cached blocks are evicted
    out = _run(engine, a)
    assert out.token_ids == _run(cold, a).token_ids
    assert out.num_cached_tokens < 192  # at least part of a was evicted
    assert engine.reset_prefix_cache()
    assert engine.scheduler.num_cached_blocks() == 0
    out = _run(engine, a)
    assert out.num_cached_tokens == 0 and out.token_ids == _run(cold, a).token_ids


def test_caching_off_reports_nothing(cold: LLMEngine) -> None:
    prompt = prompt_of_length(50)
    _run(cold, prompt)
    assert _run(cold, prompt).num_cached_tokens == 0
    assert cold.scheduler.num_cached_blocks() == 0
