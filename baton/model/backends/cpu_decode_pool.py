"""Decode attention over the block pool itself: the quantized modes' decode steps (the default).

The fused op (`cpu_fused.decode_attention_paged`) reads each decoding sequence's keys and values
straight from its blocks through its block table, and writes the new token's K/V into its slot:
nothing is kept beside the pool and nothing persists from step to step, so the whole KV budget
holds unique pool blocks (`CPUBackend.kv_memory_factor` is 0) and a preempted, recomputed or
migrated sequence needs no bookkeeping. Its arithmetic is the dense-row op's (the same per-key dot
product, softmax and value sum, keys visited in token order), so a greedy run is token for token
the one over dense rows (`tests/model/test_pool_decode.py`); the exact mode keeps its eager
attention over dense rows (`cpu_decode_rows.py`), the quality reference.

It used to be slower than the dense rows (one layer's op 1.4-3.8x, a whole int4 decode step
0.97-1.36x), because the op copied each block's values into a zeroed scratch row before the value
sum; it reads them where they lie now. One layer's op is still 1.1-1.26x the dense rows' (a
layer's K/V of one block is a 24 KB run far from the next block's), but a whole int4 decode
step over the pool takes 0.72-0.98x the rows' time at batch 1-32 x 256-1000 tokens: the rows
path also writes each new token into the pool a second time and keeps its rows' bookkeeping
(README, bench/decode_attention_bench.py and bench/decode_step.py --decode-kv).

Only a model whose every layer has plain attention takes it (no soft-capping, no scale of its
own, no sliding window: the op has none of them), computing in float32 over a float32 or bfloat16
pool; any other model keeps dense rows for every decoding sequence (`CPUBackend.set_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.model.backends import cpu_fused


@dataclass
class PoolDecode:
    """The step's sequences with one new token, read from the pool by the fused op."""

    tokens: torch.Tensor | None  # int64 [n] flat index of each token; None = the whole batch
    pool: torch.Tensor  # the KV pool [num_blocks, L, 2, B, Hkv, D]
    tables: torch.Tensor  # int64 [n, max_blocks] block table of each (contiguous)
    new_pos: torch.Tensor  # int64 [n] position of the new token (context length - 1)
    fused: bool = True  # DecodeBatch's flag: the compiled op serves these tokens


def build_pool_decode(seqlens_q: np.ndarray, seqlens_k: np.ndarray, starts: np.ndarray,
                      block_tables: torch.Tensor, kv_cache: torch.Tensor) -> PoolDecode | None:
    dec = np.flatnonzero(seqlens_q == 1)
    if len(dec) == 0:
        return None
    device = block_tables.device
    is_all = len(dec) == len(seqlens_q)
    tables = block_tables if is_all else block_tables[torch.as_tensor(dec, device=device)]
    return PoolDecode(None if is_all else torch.as_tensor(starts[dec], device=device), kv_cache,
                      tables.contiguous(), torch.as_tensor(seqlens_k[dec] - 1, device=device))


def pool_attention(qkv: torch.Tensor, cos: torch.Tensor | None, signed_sin: torch.Tensor | None,
                   d: PoolDecode, layer: int, num_heads: int) -> torch.Tensor:
    """One layer's decode attention of `d`'s tokens from their projection qkv [n, (Hq + 2 Hkv)
    D] (already rotated when cos is None): [n, Hq D]."""
    return cpu_fused.decode_attention_paged(qkv, cos, signed_sin, d.pool, layer, d.tables,
                                            d.new_pos, num_heads, d.pool.shape[4])
