"""The KV cache dtype (`--kv-cache-dtype`), independent of the weights' dtype: the pool and the
CPU backend's decode rows store it, a budget buys blocks by its size, its keys never meet
another dtype's, and every path of one engine reads the same rounded K/V (a prefix hit, a
batch, a decode row moved up a length class give the tokens a cold run gives).

Agreement of bf16 KV with float32 KV is a measurement (bench/kv_dtype.py, README), not a test:
the rounding may change a greedy token somewhere, and no test tunes prompts to hide it."""

from __future__ import annotations

import pytest
import torch
from model.reference import baton_model, prompt_of_length

from baton.engine import EngineConfig, LLMEngine
from baton.engine.block_keys import compute_block_keys
from baton.model.kv_cache import KVCacheSpec
from baton.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(dtype: str = "float32", **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"dtype": dtype, "num_blocks": 64, **overrides}),
                     loaded=baton_model(dtype))


def _run(engine: LLMEngine, prompts):
    outs = engine.generate(prompts, GREEDY)
    assert engine.num_free_blocks() == engine.num_total_blocks()
    return [o.token_ids for o in outs]


def test_bad_kv_cache_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int3'"):
        EngineConfig(kv_cache_dtype="int3")
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"


def test_a_bf16_block_is_half_a_float32_one() -> None:
    f32 = KVCacheSpec(30, 3, 64, dtype=torch.float32)
    bf16 = KVCacheSpec(30, 3, 64, dtype=torch.bfloat16)
    assert 2 * bf16.bytes_per_block == f32.bytes_per_block
    assert bf16.num_blocks_for_budget(2**26) == 2 * f32.num_blocks_for_budget(2**26)
    assert f32.fingerprint() != bf16.fingerprint()


@pytest.fixture(scope="module")
def bf16_kv() -> LLMEngine:
    return make_engine(kv_cache_dtype="bfloat16")


@pytest.fixture(scope="module")
def f32_kv() -> LLMEngine:
    return make_engine()


def test_pool_rows_and_budget_take_the_kv_dtype(bf16_kv: LLMEngine) -> None:
    assert bf16_kv.kv_cache.dtype == torch.bfloat16
    assert bf16_kv.runner.config.dtype == torch.float32  # the weights keep theirs
    _run(bf16_kv, [prompt_of_length(20)])
    assert all(g.ws is None or g.ws.dtype == torch.bfloat16
               for g in bf16_kv.runner.backend.decode_rows.groups)
    budget = 2**24  # the pool and the backend's rows together
    blocks = {kv: make_engine(num_blocks=0, kv_cache_memory_bytes=budget,
                              kv_cache_dtype=kv).num_total_blocks()
              for kv in ("auto", "bfloat16")}
    assert blocks["bfloat16"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)


def test_keys_of_two_kv_dtypes_never_meet(bf16_kv: LLMEngine, f32_kv: LLMEngine) -> None:
    assert bf16_kv.prefix_cache_seed != f32_kv.prefix_cache_seed
    prompt = prompt_of_length(64)
    assert set(compute_block_keys(prompt, 16, bf16_kv.prefix_cache_seed).tolist()).isdisjoint(
        compute_block_keys(prompt, 16, f32_kv.prefix_cache_seed).tolist())
    # The compute dtype stays in the seed: fp32 math stored as bf16 is not bf16 math.
    bf16_math = LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=4),
                          loaded=baton_model("bfloat16"))
    assert bf16_math.kv_cache.dtype == torch.bfloat16
    assert bf16_math.prefix_cache_seed != bf16_kv.prefix_cache_seed
    # ... and `auto` keeps today's keys.
    explicit = make_engine(kv_cache_dtype="float32", num_blocks=4)
    assert explicit.prefix_cache_seed == f32_kv.prefix_cache_seed


def test_every_path_reads_the_same_rounded_kv(bf16_kv: LLMEngine) -> None:
    """A prefix-cache hit and a batch give a cold, lone run's tokens (bf16 KV both ways)."""
    cold = make_engine(kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    base = prompt_of_length(120)
    prompts = [base[:70], base[:64] + base[90:100], prompt_of_length(9)]
    alone = [_run(cold, [p])[0] for p in prompts]
    assert _run(bf16_kv, prompts) == alone  # one batch: a hit among them, mixed lengths
    assert _run(bf16_kv, [prompts[1]]) == [alone[1]]  # all but the tail cached


def test_a_float32_pool_under_bf16_math_changes_nothing() -> None:
    """bf16 K/V stored in fp32 are the same numbers: the output is auto's, token for token."""
    prompts = [prompt_of_length(40), prompt_of_length(75)[30:]]
    auto = _run(make_engine("bfloat16"), prompts)
    assert _run(make_engine("bfloat16", kv_cache_dtype="float32"), prompts) == auto
