"""Prefill chunks packed into one attention call equal the one-call-per-chunk loop (float
rounding), whatever is cached; the pack leaves out the chunk that would pad the others; through
the engine, prompts prefilled together (behind cached prefixes) give each one's tokens alone; a
long chunk behind a short prefix, run as the square causal problem, equals the shifted mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine import LLMEngine
from baton.model.backends import cpu_prefill as cp
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

from .reference import baton_model, prompt_of_length

HQ, HKV, D, B = 9, 3, 64, 16


def make_step(chunks: list[tuple[int, int]], seed: int = 0):
    """A random pool holding each chunk's context (cached + new, in shuffled blocks), the step's
    q/k/v (the new tokens' K/V as the layer wrote them into the pool) and its slices."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(q + c) // B) for q, c in chunks]
    pool = torch.randn(1 + sum(need), 2, B, HKV, D, generator=gen)
    ids = (1 + torch.randperm(sum(need), generator=gen)).split(need)
    tables = torch.zeros(len(chunks), max(need), dtype=torch.int64)
    for i, row in enumerate(ids):
        tables[i, :len(row)] = row
    seqlens_q = np.array([q for q, _ in chunks])
    seqlens_k = np.array([q + c for q, c in chunks])
    starts = np.concatenate([[0], np.cumsum(seqlens_q)[:-1]]).astype(np.int64)
    kv = torch.stack([pool[tables[i, (c + j) // B], :, (c + j) % B]
                      for i, (n, c) in enumerate(chunks) for j in range(n)])
    q = torch.randn(int(seqlens_q.sum()), HQ, D, generator=gen)
    return q, kv[:, 0], kv[:, 1], pool, cp.build_slices(seqlens_q, seqlens_k, starts, tables, B)


def attention(step, batch: cp.PrefillBatch) -> torch.Tensor:
    q, k, v, pool, _ = step
    out = torch.full_like(q, float("nan"))
    cp.prefill_attention(q, k, v, pool, batch, out)
    return out


@pytest.mark.parametrize("chunks", [
    [(64, 0)] * 3,
    [(5, 0), (33, 0), (17, 0)],
    [(16, 48), (7, 9), (40, 0), (2, 30)],
    [(300, 0), (20, 0), (9, 100)],
], ids=["equal", "ragged", "cached-prefixes", "one-long"])
def test_packed_equals_the_loop(chunks) -> None:
    step = make_step(chunks)
    slices, num_tokens = step[4], step[0].shape[0]
    loop = attention(step, cp.PrefillBatch(slices, None))
    every = attention(step, cp.PrefillBatch([], cp.build_packed(slices, B, num_tokens)))
    lone, group = cp.split_pack(slices)
    picked = attention(step, cp.PrefillBatch(lone, cp.build_packed(group, B, num_tokens)
                                             if group else None))
    assert not loop.isnan().any()
    torch.testing.assert_close(every, loop, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(picked, loop, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [(512, 16), (600, 150)], ids=["behind-16", "behind-150"])
def test_square_equals_the_shifted_mask(chunk) -> None:
    """A long chunk behind a short cached prefix runs as the square causal problem over its
    whole context (zero queries for the cached positions): what the shifted mask gives."""
    step = make_step([chunk])
    q, _, _, pool, (p,) = step
    assert p.square
    out = attention(step, cp.PrefillBatch([p], None))
    ks, vs = (pool[p.block_row][:, i].reshape(-1, HKV, D)[:p.num_k].transpose(0, 1)[None]
              for i in (0, 1))
    masked = cp.attend(q.transpose(0, 1)[None], ks, vs, p.mask, False, cp.PLAIN_ATTENTION)
    torch.testing.assert_close(out, masked[0].transpose(0, 1), atol=2e-6, rtol=1e-5)


def test_which_chunks_run_square() -> None:
    """From 512 new tokens, behind a prefix of at most a quarter of them (see _SQUARE_MIN_Q)."""
    slices = make_step([(1024, 16), (1024, 256), (1024, 257), (256, 16), (511, 1), (512, 0)])[4]
    assert [p.square for p in slices] == [True, True, False, False, False, False]


def test_the_long_chunk_runs_alone() -> None:
    slices = make_step([(20, 0), (300, 0), (16, 4), (24, 0)])[4]
    lone, group = cp.split_pack(slices)
    assert [p.num_q for p in lone] == [300]
    assert [p.num_q for p in group] == [20, 16, 24]  # token order
    lone, group = cp.split_pack(slices[:2])  # one chunk left: nothing to pack
    assert (lone, group) == (slices[:2], [])


def test_prefilled_together_equals_alone() -> None:
    """Two prompts behind cached prefixes and one without, prefilled in one step (the first two in one packed
    call, the third alone): each one's greedy tokens equal its own run's; every block comes back."""
    engine = LLMEngine(engine_config(num_blocks=48, enable_prefix_caching=True),
                       loaded=baton_model())
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    base = prompt_of_length(120)
    prompts = [base[:32] + base[60:84], base[:48] + base[90:110], base[20:60]]
    engine.generate([base[:32], base[:48]], params)
    together = engine.generate(prompts, params)
    assert [o.num_cached_tokens for o in together] == [32, 48, 0]
    assert engine.reset_prefix_cache()
    alone = [engine.generate(p, params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in together] == alone
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_long_prompt_behind_a_cached_prefix_equals_uncached() -> None:
    """Through the engine: 600 new tokens behind a 32-token prefix-cache hit (one chunk, run
    square) give the greedy tokens of the same prompt uncached."""
    engine = LLMEngine(engine_config(num_blocks=96, enable_prefix_caching=True,
                                     max_num_batched_tokens=1024), loaded=baton_model())
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text = prompt_of_length(400)
    prompt = (text + text)[:632]
    engine.generate(prompt[:32], params)
    cached = engine.generate(prompt, params)[0]
    assert cached.num_cached_tokens == 32
    assert engine.reset_prefix_cache()
    uncached = engine.generate(prompt, params)[0]
    assert uncached.num_cached_tokens == 0
    assert cached.token_ids == uncached.token_ids
    assert engine.num_free_blocks() == engine.num_total_blocks()
