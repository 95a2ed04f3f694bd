"""The quantized modes' decode attention over the block pool (`cpu_decode_pool.py`) against the
same op over dense rows, the path it replaces: the op gives the same output bits for the same
keys wherever they lie, and greedy runs are token for token (and logprob for logprob) the
dense-row runs on a tiny seeded GQA Llama (int4 GGUF, head size 16: the portable loop) and on
the default model (int4, head size 64: the AVX2 loop), across many blocks, a batch of mixed
lengths and a preempted, recomputed sequence. With no rows beside it, the KV budget holds
twice the blocks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from baton.engine import EngineConfig, LLMEngine
from baton.model.backends import CPUBackend, cpu_fused
from baton.protocol import EngineStats
from baton.sampling.params import SamplingParams
from baton.service.metrics import EngineMetrics

from .tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu_fused.AVAILABLE, reason="baton._decode_ops not built")


def pool_from_rows(ws: torch.Tensor, block: int, g: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block pool [blocks, L, 2, block, Hkv, D] holding every dense row of ws [L, 2, rows,
    Hkv, cap, D] (row i = sequence i), in blocks drawn at random (block 0: null, never used):
    (pool, block tables [rows, ceil(cap / block)])."""
    layers, _, n, hkv, cap, d = ws.shape
    per = -(-cap // block)
    tables = (torch.randperm(n * per, generator=g) + 1).view(n, per)
    # The null block holds NaN: a read of it would show in every output it reached.
    pool = torch.full((n * per + 1, layers, 2, block, hkv, d), float("nan"), dtype=ws.dtype)
    for i in range(n):
        padded = torch.zeros(layers, 2, hkv, per * block, d, dtype=ws.dtype)
        padded[:, :, :, :cap] = ws[:, :, i]
        pool[tables[i]] = padded.view(layers, 2, hkv, per, block, d).permute(3, 0, 1, 4, 2, 5)
    return pool, tables


@pytest.mark.parametrize(("d", "heads", "kv_heads", "block", "dtype", "threads"), [
    (64, 9, 3, 16, torch.float32, 1),  # SmolLM2's heads: the AVX2 loop
    (64, 9, 3, 16, torch.bfloat16, 2),
    (64, 9, 3, 6, torch.float32, 2),  # blocks of 6: four-key groups cut at every block
    (128, 4, 2, 16, torch.float32, 1),
    (48, 4, 1, 5, torch.float32, 2),  # the portable loop
    (16, 4, 2, 4, torch.bfloat16, 1),  # the tiny GGUF's heads
])
def test_pool_op_gives_the_row_op_bits(d, heads, kv_heads, block, dtype, threads) -> None:
    g = torch.Generator().manual_seed(d + block)
    positions = torch.tensor([0, 3, block - 1, block, block + 1, 37, 150])
    n, cap = len(positions), 160
    ws = torch.randn(3, 2, n, kv_heads, cap, d, generator=g).to(dtype)
    pool, tables = pool_from_rows(ws, block, g)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    rows = torch.arange(n)
    untouched = pool[1:, [0, 2]].clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for c, s in ((cos, sin), (None, None)):  # rotated by the op / already rotated
            want = cpu_fused.decode_attention(qkv, c, s, ws, 1, rows, positions, heads, kv_heads)
            got = cpu_fused.decode_attention_paged(qkv, c, s, pool, 1, tables, positions, heads,
                                                   kv_heads)
            assert torch.equal(got, want)
            alone = cpu_fused.decode_attention_paged(qkv[5:6], None if c is None else c[5:6],
                                                     None if s is None else s[5:6], pool, 1,
                                                     tables[5:6], positions[5:6], heads, kv_heads)
            assert torch.equal(alone, want[5:6])  # a sequence's output is its own
    finally:
        torch.set_num_threads(before)
    # The new key and value landed where the row op put them: in block table[p // B], p % B.
    for i, p in enumerate(positions.tolist()):
        kv = pool[tables[i, p // block], 1, :, p % block]  # [2, Hkv, D]
        assert torch.equal(kv, ws[1, :, i, :, p])
    assert torch.equal(pool[1:, [0, 2]], untouched)  # the other layers as they were


def test_pool_op_refuses_tables_it_cannot_read() -> None:
    pool = torch.zeros(4, 2, 2, 4, 1, 16)
    qkv = torch.zeros(1, 4 * 16)

    def run(table, pos, layer=0):
        return cpu_fused.decode_attention_paged(qkv, None, None, pool, layer, torch.tensor([table]),
                                                torch.tensor([pos]), 2, 1)
    run([1, 2], 7)
    with pytest.raises(RuntimeError, match=r"block 0 \(sequence 0, entry 1\) out of range 1..3"):
        run([1, 0], 5)  # the null block inside the context
    with pytest.raises(RuntimeError, match="block 4"):
        run([1, 4], 5)
    with pytest.raises(RuntimeError, match="position 8 of sequence 0 out of range of its 2 blocks"):
        run([1, 2], 8)
    with pytest.raises(RuntimeError, match="layer 2 of 2"):
        run([1, 2], 1, layer=2)


def engines(loaded, **overrides) -> dict[str, LLMEngine]:
    """An engine whose fused decode op reads the pool and one whose op reads dense rows, on the
    same weights and config."""
    return {kv: LLMEngine(EngineConfig(**{"num_threads": 2, "kv_cache_memory_bytes": 2**24,
                                          "decode_kv": kv, **overrides}), loaded=loaded)
            for kv in ("pool", "rows")}  # --decode-kv pool / rows


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]


def check_pool_equals_rows(both: dict[str, LLMEngine], prompts, max_tokens: int) -> list:
    pool, rows = both["pool"].runner.backend, both["rows"].runner.backend
    assert pool.pool_decode and pool.kv_memory_factor == 0
    assert not rows.pool_decode and rows.kv_memory_factor == 1
    got, want = run(both["pool"], prompts, max_tokens), run(both["rows"], prompts, max_tokens)
    assert got == want
    assert all(g.ws is None for g in pool.decode_rows.groups)  # no dense row was ever made
    assert rows.decode_rows.num_gathered > 0
    for e in both.values():
        assert e.num_free_blocks() == e.num_total_blocks()
    return got


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    from baton.model import load_model

    loaded = load_model(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"),
                        device="cpu", quantization="auto")
    assert loaded.quantization == "int4"
    assert loaded.config.num_heads == 2 * loaded.config.num_kv_heads  # GQA
    return loaded


def test_tiny_gqa_llama_decodes_the_same_over_the_pool(tiny_int4) -> None:
    """Blocks of 4 tokens: the longest prompt spans 30 blocks before it decodes 16 more; chunks
    of 32 tokens, so the later prompts' chunks share steps with the others' decode tokens (the
    op then takes them rotated by the eager path)."""
    rng = np.random.default_rng(3)
    vocab = tiny_int4.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 7, 33, 120)]
    outs = check_pool_equals_rows(engines(tiny_int4, block_size=4, max_num_batched_tokens=32),
                                  prompts, 64)
    assert len({tuple(t) for t, _ in outs}) > 1  # not one degenerate continuation


def test_a_preempted_sequence_recomputes_the_same_over_the_pool(tiny_int4) -> None:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, tiny_int4.config.vocab_size, 30 - i).tolist() for i in range(6)]
    both = engines(tiny_int4, block_size=4, num_blocks=40)  # the batch needs 6 x 14 at the end
    check_pool_equals_rows(both, prompts, 24)
    assert all(e.num_recomputed > 0 for e in both.values())


def test_the_budget_holds_twice_the_blocks_without_rows(tiny_int4, caplog) -> None:
    budget = 2**22
    with caplog.at_level(logging.INFO, logger="baton.model.runner"):
        blocks = {(kv, dtype): e.runner.num_blocks  # the null block included
                  for dtype in ("float32", "bfloat16")
                  for kv, e in engines(tiny_int4, num_blocks=0, kv_cache_memory_bytes=budget,
                                       kv_cache_dtype=dtype).items()}
    assert "decode attention reads the pool (the whole KV budget holds its blocks)" in caplog.text
    assert "+100% of the pool for the backend's dense decode rows" in caplog.text
    rows = blocks["rows", "float32"]  # a budget of whole blocks: no rounding in the ratios
    assert (blocks["pool", "float32"], blocks["pool", "bfloat16"]) == (2 * rows, 4 * rows)
    engine = engines(tiny_int4, num_blocks=0, kv_cache_memory_bytes=budget)["pool"]
    stats = engine.tier_stats()
    assert stats["kv_tier_capacity_tokens_pool"] == engine.num_total_blocks() * 16
    assert engine.runner.capacity_tokens == engine.num_total_blocks() * 16  # the null block not
    metrics = EngineMetrics("e0", "normal")
    metrics.publish(EngineStats("e0", "normal", num_total_blocks=engine.num_total_blocks(),
                                extra=stats))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    [sample] = families["baton_kv_tier_capacity_tokens"].samples
    assert sample.labels["tier"] == "pool" and sample.value == engine.num_total_blocks() * 16


def test_the_exact_mode_and_attention_options_keep_dense_rows() -> None:
    from baton.model.backends import PLAIN_ATTENTION, AttentionOptions, get_backend

    exact = get_backend("cpu", decode_kv="pool")  # the exact mode: rows whatever it is told
    exact.set_model([PLAIN_ATTENTION] * 2, torch.float32, torch.float32)
    assert not exact.pool_decode and exact.kv_memory_factor == 1
    rows = get_backend("cpu", exact=False, decode_kv="rows")
    rows.set_model([PLAIN_ATTENTION] * 2, torch.float32, torch.float32)
    assert not rows.pool_decode and rows.kv_memory_factor == 1
    default = CPUBackend(fused_decode=True)  # the quantized modes' backend: the pool by default
    default.set_model([PLAIN_ATTENTION] * 2, torch.float32, torch.float32)
    assert default.pool_decode and default.kv_memory_factor == 0
    fused = get_backend("cpu", exact=False, decode_kv="pool")
    fused.set_model([PLAIN_ATTENTION, AttentionOptions(window=8)], torch.float32, torch.float32)
    assert not fused.pool_decode and fused.kv_memory_factor == 1
    fused.set_model([PLAIN_ATTENTION] * 2, torch.float32, torch.float16)  # no fp16 in the op
    assert not fused.pool_decode
    fused.set_model([PLAIN_ATTENTION] * 2, torch.float32, torch.bfloat16)
    assert fused.pool_decode and fused.kv_memory_factor == 0
    with pytest.raises(ValueError, match="decode_kv must be 'pool' or 'rows', got 'dense'"):
        CPUBackend(decode_kv="dense")


@pytest.mark.slow
def test_the_default_model_int4_decodes_the_same_over_the_pool() -> None:
    """SmolLM2 int4 (the servers' default): a batch of 1 / 17 / 90 / 300-token prompts, the
    longest 19 blocks of 16 before it decodes."""
    from baton.model import load_model

    from .reference import prompt_of_length

    loaded = load_model(device="cpu", quantization="int4")
    prompts = [prompt_of_length(n) for n in (1, 17, 90)] + [prompt_of_length(300)[::-1]]
    check_pool_equals_rows(engines(loaded, kv_cache_memory_bytes=2**26), prompts, 24)


def test_decode_kv_is_a_flag_of_the_engines_that_decode(capsys) -> None:
    from baton_cli.engine_main import engine_config
    from baton_cli.launch_config import role_engine_args
    from baton_cli.main import build_parser

    assert EngineConfig().decode_kv == "pool"
    for command, role in (("engine", "normal"), ("completion-engine", "completion")):
        args = build_parser().parse_args([command, "--decode-kv", "rows"])
        assert engine_config(args, role).decode_kv == "rows"
        assert engine_config(build_parser().parse_args([command]), role).decode_kv == "pool"
        assert role_engine_args(["--decode-kv", "rows"], role) == ["--decode-kv", "rows"]
    # A prompt engine has no flag (it runs no decode step): its budget holds blocks only too.
    prompt = engine_config(build_parser().parse_args(["prompt-engine"]), "prompt")
    assert prompt.decode_kv == "pool"
    assert role_engine_args(["--decode-kv", "rows"], "prompt") == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prompt-engine", "--decode-kv", "rows"])
    assert "unrecognized arguments: --decode-kv rows" in capsys.readouterr().err
    with pytest.raises(ValueError, match="decode_kv must be 'pool' or 'rows', got 'dense'"):
        EngineConfig(decode_kv="dense")
