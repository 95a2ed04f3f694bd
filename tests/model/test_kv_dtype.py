"""The KV cache dtype (`--kv-cache-dtype`), independent of the weights' dtype: the pool and the
CPU backend's decode rows store it, a budget buys blocks by its size, its keys never meet
another dtype's, and every path of one engine reads the same rounded K/V (a prefix hit, a
batch, a decode row moved up a length class give the tokens a cold run gives).

Agreement of bf16 KV with float32 KV is a measurement (bench/kv_dtype.py, README), not a test:
the rounding may change a greedy token somewhere, and no test tunes prompts to hide it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine import EngineConfig, LLMEngine
from baton.engine.block_keys import compute_block_keys
from baton.model.backends import StepBatch, cpu_fused, get_backend
from baton.model.kv_cache import KVCacheSpec
from baton.sampling.params import SamplingParams

from .reference import baton_model, prompt_of_length

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_engine(dtype: str = "float32", **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"dtype": dtype, "num_blocks": 64, "num_threads": 1,
                                     **overrides}), loaded=baton_model(dtype))


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_keys_of_two_kv_dtypes_never_meet(bf16_kv: LLMEngine, f32_kv: LLMEngine) -> None:
    assert bf16_kv.prefix_cache_seed != f32_kv.prefix_cache_seed
    prompt = prompt_of_length(64)
    assert set(compute_block_keys(prompt, 16, bf16_kv.prefix_cache_seed).tolist()).isdisjoint(
        compute_block_keys(prompt, 16, f32_kv.prefix_cache_seed).tolist())
    # `auto` keeps today's keys.
    explicit = make_engine(kv_cache_dtype="float32", num_blocks=4)
    assert explicit.prefix_cache_seed == f32_kv.prefix_cache_seed


@pytest.mark.slow
def test_every_path_reads_the_same_rounded_kv(bf16_kv: LLMEngine) -> None:
    """A prefix-cache hit and a batch give a cold, lone run's tokens (bf16 KV both ways)."""
    cold = make_engine(kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    base = prompt_of_length(120)
    prompts = [base[:70], base[:64] + base[90:100]]
    alone = [_run(cold, [p])[0] for p in prompts]
    assert _run(bf16_kv, prompts) == alone  # one batch of two lengths
    out = bf16_kv.generate(prompts[1], GREEDY)[0]  # its first 64 tokens cached
    assert out.num_cached_tokens == 64 and out.token_ids == alone[1]


@pytest.mark.slow
def test_bf16_math_over_a_float32_pool(bf16_kv: LLMEngine) -> None:
    """bf16 K/V stored in fp32 are the same numbers: the output is auto's, token for token;
    the compute dtype stays in the key seed (fp32 math stored as bf16 is not bf16 math)."""
    auto = make_engine("bfloat16")
    assert auto.kv_cache.dtype == torch.bfloat16
    assert auto.prefix_cache_seed != bf16_kv.prefix_cache_seed
    upcast = make_engine("bfloat16", kv_cache_dtype="float32")
    assert upcast.kv_cache.dtype == torch.float32
    prompts = [prompt_of_length(40), prompt_of_length(75)[30:]]
    assert _run(upcast, prompts) == _run(auto, prompts)


@pytest.mark.skipif(not cpu_fused.AVAILABLE, reason="baton._decode_ops not built")
@pytest.mark.parametrize("d", [64, 48])  # 64: the AVX2 loop; 48: the portable one
def test_fused_op_over_bf16_rows_is_the_float_op_over_rounded_ones(d: int) -> None:
    """The quantized modes' decode op reads bf16 rows as floats and rounds the new K/V to
    nearest even, as torch's .to() does: bf16 rows give what float rows holding the same
    rounded values give, bit for bit."""
    hq, hkv = 9, 3
    g = torch.Generator().manual_seed(d)
    ws = torch.randn(2, 2, 3, hkv, 40, d, generator=g).to(torch.bfloat16)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g)
    cos, sin = torch.randn(3, d, generator=g), torch.randn(3, d, generator=g)
    rows, positions = torch.tensor([2, 0, 1]), torch.tensor([7, 39, 0])
    ws32 = ws.float()
    cpu_fused.decode_attention(qkv, cos, sin, ws, 1, rows, positions, hq, hkv)
    cpu_fused.decode_attention(qkv, cos, sin, ws32, 1, rows, positions, hq, hkv)
    assert torch.equal(ws, ws32.to(torch.bfloat16))  # the new K/V rounded as torch rounds
    # K/V that bf16 holds exactly (a step with prefills hands the op rotated, rounded ones):
    # the float op over the same numbers, bit for bit.
    qkv[:, hq * d:] = qkv[:, hq * d:].to(torch.bfloat16).float()
    ws32 = ws.float()
    got = cpu_fused.decode_attention(qkv, None, None, ws, 1, rows, positions, hq, hkv)
    want = cpu_fused.decode_attention(qkv, None, None, ws32, 1, rows, positions, hq, hkv)
    assert torch.equal(got, want) and torch.equal(ws.float(), ws32)


@pytest.mark.skipif(not cpu_fused.AVAILABLE, reason="baton._decode_ops not built")
@pytest.mark.parametrize("kv_dtype,fused", [(torch.float32, True), (torch.bfloat16, True),
                                            (torch.float16, False)])
def test_quantized_modes_decode_through_the_op_over_bf16_rows(kv_dtype, fused: bool) -> None:
    """The quantized modes keep their fused decode op over a bf16 pool (float16: eager)."""
    backend = get_backend("cpu", exact=False)
    kv = torch.zeros(3, 2, 2, 16, 3, 64, dtype=kv_dtype)  # [blocks, layers, 2, B, Hkv, D]
    one = torch.tensor([1])
    batch = StepBatch(one * 5, one * 3, one * 19, one[None], np.array([1]), np.array([4]),
                      np.array([0]))
    meta = backend.prepare(batch, kv, torch.float32)
    assert meta.decode.fused is fused
    assert meta.decode.groups[0].group.ws.dtype == kv_dtype


def test_baton_up_hands_one_kv_dtype_to_every_engine() -> None:
    from baton_cli.launcher import LaunchConfig, Launcher

    launcher = Launcher(LaunchConfig(kv_cache_dtype="bf16"))
    auto = Launcher(LaunchConfig(num_normal_engines=1, num_prompt_engines=0,
                                 num_completion_engines=0))
    try:  # _start_engine spawns the engine: stop them, so that no child outlives the test
        for command in ("prompt-engine", "completion-engine"):
            launcher._start_engine(command, command, 1, "")
        for child in launcher.children:
            i = child.argv.index("--kv-cache-dtype")
            assert child.argv[i + 1] == "bfloat16"
        auto._start_engine("engine", "e", 1, "")
        assert "--kv-cache-dtype" not in auto.children[0].argv  # auto: each engine's --dtype
    finally:
        launcher.stop()
        auto.stop()
    with pytest.raises(ValueError, match="give --kv-cache-dtype to `baton up` itself"):
        LaunchConfig(engine_args=["--kv-cache-dtype=bfloat16"])
    with pytest.raises(ValueError, match="kv_cache_dtype 'int3'"):
        LaunchConfig(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="--mock engines have no KV dtype"):
        LaunchConfig(mock="profile.json", kv_cache_dtype="bfloat16")
