"""Prefill attention of the CPU backend: the chunks of one step with more than one new token.

Chunks of similar size run as one padded attention call, the others one call each:

    packed chunks  q    [S, Hq,  max_q, D]  gathered from the step's new tokens
                   k, v [S, Hkv, max_k, D]  gathered from the pool, which already holds every
                                            new token's K/V (the layer wrote it first)
                   mask [S, 1, max_q, max_k]  key j visible to row r iff j <= cached + r and
                                              j < num_k; padding rows see their chunk's keys
                                              (finite) and are dropped afterwards
    lone chunks    one SDPA each: plain causal over the new K/V when nothing is cached, else
                   over the chunk's blocks with the causal mask shifted by the cached length,
                   or, a long chunk behind a short prefix, plain causal over the whole context
                   with zero queries for the cached positions (`PrefillSlice.square`)

The padded call computes S * max_q * max_k query-key pairs, the loop sum(num_q * num_k) (torch's
CPU kernel gains little from `is_causal`: 256 x 256 on one thread, 7.1 ms causal vs 7.4 ms
masked) plus one call's overhead per chunk (~20 us on one idle thread, far more when the cores
are shared and each call waits for its threads). A chunk leaves the pack (largest first) while
that ratio is over `_PACK_MAX_WASTE`: one long prompt among short ones runs alone, and the short
ones still go together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from baton.model.backends.base import PLAIN_ATTENTION, AttentionOptions

# Padded work over useful work at which a chunk runs alone instead (see the module docstring);
# measured with bench/prefill_attention_bench.py.
_PACK_MAX_WASTE = 1.5
# A chunk behind a cached prefix runs as the square causal problem over its whole context (zero
# queries for the cached positions, their rows dropped) from this many new tokens, and while the
# prefix is at most this share of them. torch's CPU SDPA skips the key blocks past the diagonal
# only with `is_causal`, which it aligns top-left: a shifted mask makes it compute every pair.
# One thread, per layer (9 query / 3 KV heads of 64), masked -> square: 1,024 new behind 16
# cached 32.9 -> 22.8 ms, behind 256 39.8 -> 31.0; 640 behind 32 13.5 -> 11.0, behind 128
# 15.5 -> 13.6; 512 behind 16 9.6 -> 8.1, behind 64 9.2 -> 8.9 (behind 128 10.1 -> 11.2, the one
# loss seen inside the rule). Worse below 512 new tokens (384 behind 16: x1.18, 256: x1.04) and
# behind longer prefixes (768 behind 512: x1.05). The same kernel either way: outputs bitwise
# equal (7 December 2026).
_SQUARE_MIN_Q = 512
_SQUARE_MAX_PREFIX = 0.25


@dataclass
class PrefillSlice:
    """One sequence with more than one new token."""

    start: int  # first token in the flat batch
    num_q: int
    num_k: int  # context length after this step
    num_blocks: int  # blocks holding num_k tokens
    block_row: torch.Tensor  # int64 [num_blocks]
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask

    @property
    def square(self) -> bool:
        """Whether this chunk, behind a cached prefix, runs as the square causal problem over
        its whole context (see `_SQUARE_MIN_Q`)."""
        cached = self.num_k - self.num_q
        return 0 < cached <= _SQUARE_MAX_PREFIX * self.num_q and self.num_q >= _SQUARE_MIN_Q

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """bool [num_q, num_k], the causal mask shifted by the cached length; None when nothing
        was cached (plain causal). Built at a lone chunk's first layer only: a packed chunk
        shares the pack's mask."""
        cached = self.num_k - self.num_q
        if not cached:
            return None
        rows = torch.arange(self.num_q, device=self.block_row.device)[:, None] + cached
        return torch.arange(self.num_k, device=self.block_row.device)[None, :] <= rows

    def window_mask(self, window: int) -> torch.Tensor:
        """bool [num_q, num_k]: causal and within `window` positions of the query (built once
        per window and step, shared by the layers with that window)."""
        mask = self._window_masks.get(window)
        if mask is None:
            device = self.block_row.device
            rows = torch.arange(self.num_q, device=device)[:, None] + (self.num_k - self.num_q)
            keys = torch.arange(self.num_k, device=device)[None, :]
            mask = self._window_masks[window] = (keys <= rows) & (keys > rows - window)
        return mask


@dataclass
class PackedPrefill:
    """Chunks served by one padded attention call (the module docstring's picture)."""

    q_index: torch.Tensor  # int64 [S * max_q] flat token of each padded query row
    rows: torch.Tensor  # int64 [sum num_q] padded rows that are real tokens, in token order
    tokens: torch.Tensor | None  # int64 [sum num_q] their flat tokens; None = the whole batch
    key_blocks: torch.Tensor  # int64 [S, max_k] block of each padded key
    key_offsets: torch.Tensor  # int64 [S, max_k] offset inside that block
    mask: torch.Tensor  # bool [S, 1, max_q, max_k]
    num_seqs: int
    max_q: int
    q_pos: torch.Tensor  # int64 [S, max_q] position of each padded query row
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` restricted to keys within `window` positions of each query row."""
        mask = self._window_masks.get(window)
        if mask is None:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            mask = self.mask & (keys[None, None, None, :] > self.q_pos[:, None, :, None] - window)
            self._window_masks[window] = mask
        return mask


@dataclass
class PrefillBatch:
    lone: list[PrefillSlice]  # one attention call each
    packed: PackedPrefill | None


def build_slices(seqlens_q: np.ndarray, seqlens_k: np.ndarray, starts: np.ndarray,
                 block_tables: torch.Tensor, block_size: int) -> list[PrefillSlice]:
    slices = []
    for i in np.flatnonzero(seqlens_q > 1):
        q, k = int(seqlens_q[i]), int(seqlens_k[i])
        nb = -(-k // block_size)
        slices.append(PrefillSlice(int(starts[i]), q, k, nb, block_tables[i, :nb]))
    return slices


def _pairs(p: PrefillSlice) -> int:
    return p.num_q * p.num_k


def _waste(group: list[PrefillSlice]) -> float:
    """Query-key pairs the padded call computes over those of the chunks' own calls."""
    padded = len(group) * max(p.num_q for p in group) * max(p.num_k for p in group)
    return padded / sum(_pairs(p) for p in group)


def split_pack(slices: list[PrefillSlice]) -> tuple[list[PrefillSlice], list[PrefillSlice]]:
    """(lone, packed): the largest chunks leave the pack until its padding is within bounds."""
    group = sorted(slices, key=_pairs)
    lone = []
    while len(group) > 1 and _waste(group) > _PACK_MAX_WASTE:
        lone.append(group.pop())
    if len(group) < 2:
        return slices, []
    group.sort(key=lambda p: p.start)  # token order: the real rows come out in flat order
    return lone, group


def build_packed(group: list[PrefillSlice], block_size: int, num_tokens: int) -> PackedPrefill:
    device = group[0].block_row.device
    num_seqs = len(group)
    max_q, max_k = max(p.num_q for p in group), max(p.num_k for p in group)
    r = torch.arange(max_q, device=device)
    j = torch.arange(max_k, device=device)
    q_index = torch.empty((num_seqs, max_q), dtype=torch.int64, device=device)
    key_blocks = torch.empty((num_seqs, max_k), dtype=torch.int64, device=device)
    key_offsets = torch.empty((num_seqs, max_k), dtype=torch.int64, device=device)
    mask = torch.empty((num_seqs, 1, max_q, max_k), dtype=torch.bool, device=device)
    q_pos = torch.empty((num_seqs, max_q), dtype=torch.int64, device=device)
    for s, p in enumerate(group):
        q_pos[s] = r + (p.num_k - p.num_q)
        q_index[s] = p.start + r.clamp(max=p.num_q - 1)  # padding rows repeat the last token
        pos = j.clamp(max=p.num_k - 1)  # padding keys repeat the last key (masked out)
        key_blocks[s] = p.block_row[pos // block_size]
        key_offsets[s] = pos % block_size
        mask[s, 0] = (j[None, :] <= r[:, None] + (p.num_k - p.num_q)) & (j[None, :] < p.num_k)
    rows = torch.cat([s * max_q + torch.arange(p.num_q, device=device)
                      for s, p in enumerate(group)])
    tokens = torch.cat([p.start + torch.arange(p.num_q, device=device) for p in group])
    is_all = len(tokens) == num_tokens  # the whole batch: rows come out in flat order
    return PackedPrefill(q_index.view(-1), rows, None if is_all else tokens, key_blocks,
                         key_offsets, mask, num_seqs, max_q, q_pos)


def build_prefill(seqlens_q: np.ndarray, seqlens_k: np.ndarray, starts: np.ndarray,
                  block_tables: torch.Tensor, block_size: int) -> PrefillBatch:
    lone, group = split_pack(build_slices(seqlens_q, seqlens_k, starts, block_tables,
                                          block_size))
    packed = build_packed(group, block_size, int(seqlens_q.sum())) if group else None
    return PrefillBatch(lone, packed)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, options: AttentionOptions) -> torch.Tensor:
    """SDPA over [B, H, L, D] tensors (bool mask: True = visible), or, where SDPA cannot
    express the layer's options (soft-capping), the eager formula transformers runs for it."""
    if k.dtype != q.dtype:  # K/V of another KV dtype: attention runs in the compute dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    gqa = q.shape[1] > k.shape[1]
    if options.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=options.scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if options.scale is None else options.scale
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores.div_(options.softcap).tanh_().mul_(options.softcap)
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def packed_attention(q: torch.Tensor, layer_kv: torch.Tensor, p: PackedPrefill,
                     options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
    """The packed chunks' attention; returns [sum num_q, Hq, D] in token order."""
    _, num_heads, head_dim = q.shape
    qs = q[p.q_index].view(p.num_seqs, p.max_q, num_heads, head_dim).transpose(1, 2)
    # Advanced indices on dims 0 and 2 around a slice: the view is [S, max_k, 2, Hkv, D].
    kv = layer_kv[p.key_blocks, :, p.key_offsets]
    ks, vs = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    mask = p.mask if options.window is None else p.window_mask(options.window)
    o = attend(qs, ks, vs, mask, False, options)
    return o.transpose(1, 2).reshape(-1, num_heads, head_dim)[p.rows]


def lone_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                   p: PrefillSlice, options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
    """One chunk's attention; returns [num_q, Hq, D]."""
    _, _, block_size, num_kv_heads, head_dim = layer_kv.shape
    qs = q[p.start:p.start + p.num_q].transpose(0, 1)[None]  # [1, Hq, q, D]
    cached = p.num_k - p.num_q
    if not cached:
        ks = k[p.start:p.start + p.num_q].transpose(0, 1)[None]
        vs = v[p.start:p.start + p.num_q].transpose(0, 1)[None]
    else:
        kv = layer_kv[p.block_row].transpose(0, 1)  # [2, nb, B, Hkv, D]
        kv = kv.reshape(2, p.num_blocks * block_size, num_kv_heads, head_dim)
        ks = kv[0, :p.num_k].transpose(0, 1)[None]
        vs = kv[1, :p.num_k].transpose(0, 1)[None]
    if p.square and options.window is None and options.softcap is None:
        # Each query row is computed alone, so the zero rows change nothing in the real ones.
        padded = qs.new_zeros(1, qs.shape[1], p.num_k, qs.shape[3])
        padded[:, :, cached:] = qs
        return attend(padded, ks, vs, None, True, options)[0, :, cached:].transpose(0, 1)
    mask = p.mask if options.window is None else p.window_mask(options.window)
    o = attend(qs, ks, vs, mask, mask is None, options)
    return o[0].transpose(0, 1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                      batch: PrefillBatch, out: torch.Tensor,
                      options: AttentionOptions = PLAIN_ATTENTION) -> None:
    """Writes every prefill token's attention output into `out` [T, Hq, D]."""
    if batch.packed is not None:
        o = packed_attention(q, layer_kv, batch.packed, options)
        if batch.packed.tokens is None:
            out.copy_(o)
        else:
            out[batch.packed.tokens] = o
    for p in batch.lone:
        out[p.start:p.start + p.num_q] = lone_attention(q, k, v, layer_kv, p, options)
