"""Llama-family decoder over a paged KV pool: one forward for prefill chunks and batched decode.

The batch is flat: the tokens of all scheduled sequences one after another, as the scheduler's
`SchedulerOutputs` gives them. Everything index-like (slots, decode gather, masks, last tokens) is
built once per forward in `AttentionMetadata` and shared by all layers. Per layer, every new
token's K/V is written into the pool at its slot, then attention runs:
  * sequences with one query token (decode) are served together over dense rows that persist
    from step to step (`DecodeRows`, `[layers, 2, rows, kv_heads, capacity, head_dim]`, grouped
    by length class so that one long sequence does not pad every short one): a row is
    gathered from the blocks once, when its sequence starts decoding, and then each layer appends
    the new token's K/V to it as well as to the pool, and runs one masked
    `scaled_dot_product_attention` call over views of it (no per-step gather, no GQA repeat);
  * longer chunks (prefill) run one sequence at a time with a causal mask shifted by the number
    of tokens already cached, so a chunk sees the earlier chunks of its prompt.
Only the last token of each sequence goes through the final norm and the LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from baton.model.config import ModelConfig
from baton.model.decode_rows import DecodeRows, RowGroup

logger = logging.getLogger(__name__)

ArrayLike = torch.Tensor | np.ndarray | list


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics whatever the activation dtype, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# Few rows: MKL runs these GEMMs on one thread whatever torch.set_num_threads says (measured on
# the 2-core CPU: 1 and 2 threads take the same time up to ~64 rows).
_SPLIT_MAX_ROWS = 64
_ONEDNN = torch.backends.mkldnn.is_available()
_MATH_ATTENTION_MAX_LEN = 256  # decode contexts up to this use matmul + softmax, longer SDPA


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) that keeps every intra-op thread busy for a decode batch:
    the weight's output rows are cut into one part per thread, viewed as a batch (no copy), and
    one `bmm` runs the parts in parallel. 1.3-1.5x faster for 1-32 rows on 2 threads; large
    batches (prefill) keep MKL's own threading."""
    parts = torch.get_num_threads()
    rows, (n, k) = x.shape[0], weight.shape
    if parts < 2 or rows > _SPLIT_MAX_ROWS or n % parts or x.device.type != "cpu":
        return F.linear(x, weight)
    w = weight.view(parts, n // parts, k).transpose(1, 2)  # [parts, k, n / parts]
    return torch.bmm(x.expand(parts, rows, k), w).transpose(0, 1).reshape(rows, n)


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The vocabulary projection, the largest GEMM of a decode step (49152 x 576 for SmolLM2):
    oneDNN's matmul, which threads it, beats MKL's 1.3-1.8x on this CPU at 8-256 rows."""
    if _ONEDNN and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def rope_table(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_position, head_dim]` in fp32 (HF's non-interleaved "rotate_half" layout)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    pos = torch.arange(config.max_position, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` with the sign of rotate_half folded into `signed_sin`
    (negation is exact, so the result is bit-identical) and the two halves swapped by `roll`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass
class PrefillSlice:
    """One sequence with more than one new token."""

    start: int  # first token in the flat batch
    num_q: int
    num_k: int  # context length after this step
    num_blocks: int  # blocks holding num_k tokens
    block_row: torch.Tensor  # int64 [num_blocks]
    mask: torch.Tensor | None  # bool [num_q, num_k]; None when nothing was cached (plain causal)


@dataclass
class DecodeGroup:
    """The batch entries whose rows live in one `RowGroup`, viewed as `kv [num_layers, 2, n,
    num_kv_heads, max_len, head_dim]`; each layer writes its new K/V there too and runs one masked
    attention call over its slice. Rows are a permutation of the entries: `rows[i]` is entry i's."""

    group: RowGroup
    index: torch.Tensor | None  # int64 [n] entries of the decode batch; None = all of them
    rows: torch.Tensor  # int64 [n] row of each entry
    permutation: torch.Tensor | None  # = rows, or None when rows are 0..n-1 in entry order
    new_pos: torch.Tensor  # int64 [n] position of the new token (context length - 1)
    lens: np.ndarray  # int64 [n] context length of each entry after this step
    mask: torch.Tensor  # additive [n, 1, 1, max_len] in row order: 0 up to the length, -inf after
    kv: torch.Tensor  # the workspace view described above


@dataclass
class DecodeBatch:
    """The sequences with one new token, served from their persistent dense rows
    (`DecodeRows`), one attention call per length-class group."""

    tokens: torch.Tensor | None  # int64 [n] flat index of each token; None = the whole batch
    groups: list[DecodeGroup]


@dataclass
class AttentionMetadata:
    """Everything attention needs, built once per forward and shared by all layers."""

    slot_blocks: torch.Tensor  # int64 [T] block id of each new token
    slot_offsets: torch.Tensor  # int64 [T] offset inside that block
    decode: DecodeBatch | None
    prefills: list[PrefillSlice]
    last_token: torch.Tensor | None  # int64 [n] flat index of each sequence's last token; None = all


def build_decode(seqlens_q: np.ndarray, seqlens_k: np.ndarray, starts: np.ndarray,
                 seq_ids: np.ndarray, block_tables: torch.Tensor, kv_cache: torch.Tensor,
                 decode_rows: DecodeRows, dtype: torch.dtype) -> DecodeBatch | None:
    dec = np.flatnonzero(seqlens_q == 1)
    if len(dec) == 0:
        return None
    device = block_tables.device
    lens = seqlens_k[dec]
    is_all = len(dec) == len(seqlens_q)
    tables = block_tables if is_all else block_tables[torch.as_tensor(dec, device=device)]
    groups = []
    prepared = decode_rows.prepare(seq_ids[dec], lens, tables, kv_cache, kv_cache.shape[3])
    for group, index, rows in prepared:
        glens = lens[index]
        n, max_len = len(index), int(glens.max())
        identity = bool((rows == torch.arange(n, device=device)).all())
        lens_t = torch.as_tensor(glens, device=device)
        row_lens = lens_t if identity else torch.empty_like(lens_t).index_copy_(0, rows, lens_t)
        mask = torch.zeros((n, max_len), dtype=dtype, device=device)
        mask.masked_fill_(torch.arange(max_len, device=device)[None, :] >= row_lens[:, None],
                          float("-inf"))
        groups.append(DecodeGroup(
            group, None if len(prepared) == 1 else torch.as_tensor(index, device=device), rows,
            None if identity else rows, lens_t - 1, glens, mask[:, None, None, :],
            group.ws[:, :, :n, :, :max_len]))
    tokens = None if is_all else torch.as_tensor(starts[dec], device=device)
    return DecodeBatch(tokens, groups)


def build_metadata(slot_mapping: torch.Tensor, seqlens_q: np.ndarray, seqlens_k: np.ndarray,
                   seq_ids: np.ndarray, block_tables: torch.Tensor, kv_cache: torch.Tensor,
                   decode_rows: DecodeRows, dtype: torch.dtype) -> AttentionMetadata:
    device = block_tables.device
    block_size = kv_cache.shape[3]
    starts = np.concatenate([[0], np.cumsum(seqlens_q)[:-1]]).astype(np.int64)
    decode_rows.forget(seq_ids[seqlens_q > 1])  # their K/V is being (re)written by a prefill
    decode = build_decode(seqlens_q, seqlens_k, starts, seq_ids, block_tables, kv_cache,
                          decode_rows, dtype)
    prefills = []
    for i in np.flatnonzero(seqlens_q > 1):
        q, k = int(seqlens_q[i]), int(seqlens_k[i])
        cached = k - q
        mask = None
        if cached:
            rows = torch.arange(q, device=device)[:, None] + cached
            mask = torch.arange(k, device=device)[None, :] <= rows
        nb = -(-k // block_size)
        prefills.append(PrefillSlice(int(starts[i]), q, k, nb, block_tables[i, :nb], mask))
    last = None  # an all-decode batch: every token is its sequence's last
    if decode is None or decode.tokens is not None:
        last = torch.as_tensor(starts + seqlens_q.astype(np.int64) - 1, device=device)
    return AttentionMetadata(slot_mapping // block_size, slot_mapping % block_size,
                             decode, prefills, last)


class LlamaLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + swiglu(norm(x)). Q/K/V and gate/up are fused."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        c = config
        self.config = c
        self.index = index
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=c.dtype), requires_grad=False)  # noqa: E731
        self.input_norm = empty(c.hidden_size)
        self.qkv_proj = empty(qkv_rows, c.hidden_size)
        self.o_proj = empty(c.hidden_size, c.num_heads * c.head_dim)
        self.post_norm = empty(c.hidden_size)
        self.gate_up_proj = empty(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = empty(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                layer_kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = linear(h, self.qkv_proj)
        num_qk_heads = c.num_heads + c.num_kv_heads
        # Q and K heads are rotated together; V is a view of the projection.
        qk = apply_rope(qkv[:, :num_qk_heads * c.head_dim].view(-1, num_qk_heads, c.head_dim),
                        cos, signed_sin)
        q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        v = qkv[:, num_qk_heads * c.head_dim:].view(-1, c.num_kv_heads, c.head_dim)
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T, 2, H, D].
        layer_kv[meta.slot_blocks, :, meta.slot_offsets] = torch.stack((k, v), dim=1)
        attn = paged_attention(q, k, v, layer_kv, meta, c, self.index)
        x = x + linear(attn.reshape(x.shape[0], -1), self.o_proj)
        h = rms_norm(x, self.post_norm, c.rms_norm_eps)
        gate, up = linear(h, self.gate_up_proj).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down_proj)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: DecodeBatch,
                     c: ModelConfig, layer: int) -> torch.Tensor:
    """Attention of all single-token sequences, one call per row group; returns [n, Hq, D]."""
    if d.tokens is not None:
        q, k, v = q[d.tokens], k[d.tokens], v[d.tokens]
    if len(d.groups) == 1:
        return group_attention(q, k, v, d.groups[0], c, layer)
    out = torch.empty_like(q)
    for g in d.groups:
        out[g.index] = group_attention(q[g.index], k[g.index], v[g.index], g, c, layer)
    return out


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: DecodeGroup,
                    c: ModelConfig, layer: int) -> torch.Tensor:
    n = q.shape[0]
    dense = g.kv[layer]  # [2, n, Hkv, max_len, D]
    # Advanced indices on dims 1 and 3 around a slice: the indexed view is [n, 2, Hkv, D].
    dense[:, g.rows, :, g.new_pos] = torch.stack((k, v), dim=1)
    # The query heads sharing a KV head ride as its query rows: no K/V repeat, no copy.
    qd = q.reshape(n, c.num_kv_heads, c.num_queries_per_kv, c.head_dim)
    if g.permutation is not None:
        qd = torch.empty_like(qd).index_copy_(0, g.permutation, qd)
    keys, vals = dense[0], dense[1]  # [n, Hkv, max_len, D]
    if keys.shape[2] <= _MATH_ATTENTION_MAX_LEN:
        # Two batched GEMMs and a softmax: for short contexts the fused CPU kernel's own
        # overhead dominates (batch 32 x 80 tokens: 221 vs 364 us a layer on 2 threads).
        scores = torch.matmul(qd, keys.transpose(-1, -2)).mul_(c.head_dim ** -0.5).add_(g.mask)
        out = torch.matmul(scores.softmax(-1), vals)
    else:
        out = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=g.mask)
    if g.permutation is not None:
        out = out[g.permutation]
    return out.reshape(n, c.num_heads, c.head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                    meta: AttentionMetadata, c: ModelConfig, layer: int) -> torch.Tensor:
    """Attention of each new token over its sequence's cached + new K/V. q [T, Hq, D]."""
    d = meta.decode
    if d is not None and d.tokens is None:
        return decode_attention(q, k, v, d, c, layer)
    out = torch.empty_like(q)
    if d is not None:
        out[d.tokens] = decode_attention(q, k, v, d, c, layer)
    block_size = layer_kv.shape[2]
    group = c.num_queries_per_kv
    for p in meta.prefills:
        qs = q[p.start:p.start + p.num_q].transpose(0, 1)[None]  # [1, Hq, q, D]
        if p.mask is None:
            ks = k[p.start:p.start + p.num_q].transpose(0, 1)[None]
            vs = v[p.start:p.start + p.num_q].transpose(0, 1)[None]
        else:
            kv = layer_kv[p.block_row].transpose(0, 1)  # [2, nb, B, Hkv, D]
            kv = kv.reshape(2, p.num_blocks * block_size, c.num_kv_heads, c.head_dim)
            ks = kv[0, :p.num_k].transpose(0, 1)[None]
            vs = kv[1, :p.num_k].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask,
                                           is_causal=p.mask is None, enable_gqa=group > 1)
        out[p.start:p.start + p.num_q] = o[0].transpose(0, 1)
    return out


class LlamaModel(nn.Module):
    """Llama / SmolLM / Mistral-style decoder (no biases, RoPE, RMSNorm, GQA, SwiGLU)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=c.dtype),
                                         requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(c, i) for i in range(c.num_layers))
        self.norm = nn.Parameter(torch.empty(c.hidden_size, dtype=c.dtype), requires_grad=False)
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, dtype=c.dtype), requires_grad=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, signed sin
        self.decode_rows = DecodeRows()  # decode K/V, kept across steps

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's LlamaForCausalLM (`model.layers.0.self_attn.q_proj.weight`...)."""
        from baton.model.weights import assign_hf_weights

        assign_hf_weights(self, weights)
        self._rope = None

    @torch.inference_mode()
    def forward(self, input_ids: ArrayLike, positions: ArrayLike, slot_mapping: ArrayLike,
                seqlens_q: ArrayLike, seqlens_k: ArrayLike, block_tables: ArrayLike,
                kv_cache: torch.Tensor, seq_ids: ArrayLike | None = None) -> torch.Tensor:
        """Run one flat batch; write its K/V into `kv_cache`; return fp32 logits [n, vocab] of the
        last token of each sequence. `seqlens_k` is each sequence's context length after the step,
        `slot_mapping` is block_id * block_size + offset for each token of `input_ids`.
        `seq_ids` (the scheduler's, unique per live sequence) lets a decoding sequence keep its
        dense K/V rows from step to step; without them every decode step gathers them anew."""
        dev = self.device
        c = self.config
        if self._rope is None:
            cos, sin = rope_table(c, dev)
            half = c.head_dim // 2
            self._rope = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        ids = torch.as_tensor(np.asarray(input_ids), device=dev).long()
        pos = torch.as_tensor(np.asarray(positions), device=dev).long()
        slots = torch.as_tensor(np.asarray(slot_mapping), device=dev).long()
        tables = torch.as_tensor(np.asarray(block_tables), device=dev).long()
        q_lens = np.asarray(seqlens_q, dtype=np.int64)
        k_lens = np.asarray(seqlens_k, dtype=np.int64)
        assert q_lens.sum() == ids.shape[0] == pos.shape[0] == slots.shape[0], "ragged batch"
        if seq_ids is None:
            self.decode_rows.reset()  # no identities: nothing may be matched across steps
            seq_ids = np.arange(len(q_lens))
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        meta = build_metadata(slots, q_lens, k_lens, seq_ids, tables, kv_cache, self.decode_rows,
                              c.dtype)
        cos = self._rope[0][pos][:, None, :].to(c.dtype)
        sin = self._rope[1][pos][:, None, :].to(c.dtype)
        x = F.embedding(ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i], meta)
        if meta.decode is not None:
            for g in meta.decode.groups:
                g.group.commit(g.rows, g.lens)
        if meta.last_token is not None:
            x = x[meta.last_token]
        x = rms_norm(x, self.norm, c.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return lm_head(x, head).float()
