"""The CPU backend: threaded few-row GEMMs, oneDNN's LM head, paged attention.

Per step, everything index-like (slots, decode rows, masks, last tokens) is built once in
`AttentionMetadata` and shared by all layers. Per layer, every new token's K/V is written into
the pool at its slot, then attention runs:
  * sequences with one query token (decode), in the quantized modes on a model with plain
    attention (`decode_kv="pool"`, the default), are served by one compiled op a layer that
    reads the pool itself through their block tables (`cpu_decode_pool.py`): no copy of the KV
    anywhere else, the whole KV budget buys pool blocks, decode steps as fast as over rows;
  * otherwise (the exact mode, the quality reference: eager attention; `decode_kv="rows"`; a
    model with soft-capping, a scale of its own or sliding windows) they are served over dense rows that persist
    from step to step (`DecodeRows`, `[layers, 2, rows, kv_heads, capacity, head_dim]`, grouped
    by length class so that one long sequence does not pad every short one): a row is gathered
    from the blocks once, when its sequence starts decoding, and then each layer appends the new
    token's K/V to it as well as to the pool, and runs one masked attention call over views of
    it (no per-step gather, no GQA repeat);
  * longer chunks (prefill) run with a causal mask shifted by the number of tokens already
    cached, so a chunk sees the earlier chunks of its prompt; chunks of similar size share one
    padded attention call (`cpu_prefill.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from baton.model.backends import cpu_fused
from baton.model.backends.base import PLAIN_ATTENTION, AttentionOptions, StepBatch
from baton.model.backends.cpu_decode_pool import PoolDecode, build_pool_decode, pool_attention
from baton.model.backends.cpu_decode_rows import DecodeRows, RowGroup
from baton.model.backends.cpu_prefill import PrefillBatch, build_prefill, prefill_attention
from baton.model.quant import QuantizedWeight

logger = logging.getLogger(__name__)

# Few rows: MKL runs these GEMMs on one thread whatever torch.set_num_threads says (measured on
# the 2-core CPU: 1 and 2 threads take the same time up to ~64 rows).
_SPLIT_MAX_ROWS = 64
_ONEDNN = torch.backends.mkldnn.is_available()
# oneDNN refuses bf16 matmuls on a CPU without AVX512 (this AVX2 EPYC: "could not create a
# primitive descriptor"); MKL's F.linear runs them anywhere.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN and \
    torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
_MATH_ATTENTION_MAX_LEN = 256  # decode contexts up to this use matmul + softmax, longer SDPA


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) that keeps every intra-op thread busy for a decode batch:
    the weight's output rows are cut into one part per thread, viewed as a batch (no copy), and
    one `bmm` runs the parts in parallel. 1.3-1.5x faster for 1-32 rows on 2 threads; large
    batches (prefill) keep MKL's own threading. A quantized weight is multiplied as its dense
    copy here; `CPUBackend.linear` sends decode rows through its block kernel."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dense
    parts = torch.get_num_threads()
    rows, (n, k) = x.shape[0], weight.shape
    if parts < 2 or rows > _SPLIT_MAX_ROWS or n % parts:
        return F.linear(x, weight)
    w = _split_view(weight, parts)  # [parts, k, n / parts]
    out = torch.bmm(x.expand(parts, rows, k), w)  # [parts, rows, n / parts]
    # One row: the parts already lie in output order, the reshape is a view.
    return out.view(1, n) if rows == 1 else out.transpose(0, 1).reshape(rows, n)


def _split_view(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """The weight's output rows as `parts` batch entries, [parts, k, n / parts] (a view), kept
    on the weight itself: building it costs two dispatches, four linears a layer."""
    cached = getattr(weight, "_baton_split", None)
    if cached is None or cached.shape[0] != parts:
        n, k = weight.shape
        cached = weight.view(parts, n // parts, k).transpose(1, 2)
        weight._baton_split = cached
    return cached


def portable_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):  # the block kernels are CPU-only
        weight = weight.dense
    return F.linear(x, weight)


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The vocabulary projection, the largest GEMM of a decode step (49152 x 576 for SmolLM2):
    oneDNN's matmul, which threads it, beats MKL's 1.3-1.8x on this CPU at 8-256 rows. A
    quantized head is multiplied as its dense copy here (`CPUBackend.lm_head`: the kernel)."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dense
    if _ONEDNN and x.dtype in _ONEDNN_DTYPES:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


@dataclass
class DecodeGroup:
    """The batch entries whose rows live in one `RowGroup`, viewed as `kv [num_layers, 2, R,
    num_kv_heads, max_len, head_dim]` (R: the first rows, up to the last entry's); each layer
    writes its new K/V there too and runs one masked attention call over its slice. `rows[i]`
    is entry i's row; R = n (rows a permutation of the entries) unless a row among them belongs
    to a sequence that verifies drafts this step (kept for its next step): the eager path
    then attends over that row too, and drops what it gives."""

    group: RowGroup
    index: torch.Tensor | None  # int64 [n] entries of the decode batch; None = all of them
    rows: torch.Tensor  # int64 [n] row of each entry
    permutation: torch.Tensor | None  # = rows, or None when rows are 0..n-1 in entry order
    new_pos: torch.Tensor  # int64 [n] position of the new token (context length - 1)
    lens: np.ndarray  # int64 [n] context length of each entry after this step
    # additive [R, 1, 1, max_len] in row order: 0 up to the length, -inf after (0 for a row
    # that is no entry's); None when every entry is max_len long (batch 1 always): adding zeros
    # changes nothing but costs a dispatch.
    mask: torch.Tensor | None
    kv: torch.Tensor  # the workspace view described above, in the pool's dtype
    dtype: torch.dtype  # the compute dtype: the masks', and what attention reads the rows as
    _window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # window -> mask

    def window_mask(self, window: int) -> torch.Tensor | None:
        """`mask` plus -inf at the keys `window` or more positions behind each row's new token
        (row order); None where no row reaches past its window."""
        if window in self._window_masks:
            return self._window_masks[window]
        mask = self.mask
        if int(self.lens.max()) > window:
            pos = self.new_pos if self.permutation is None else self.new_pos.new_full(
                (self.kv.shape[2],), self.kv.shape[4] - 1).index_copy_(0, self.rows, self.new_pos)
            keys = torch.arange(self.kv.shape[4], device=pos.device)
            far = torch.zeros((len(pos), self.kv.shape[4]), dtype=self.dtype, device=pos.device)
            far.masked_fill_(keys[None, :] <= pos[:, None] - window, float("-inf"))
            far = far[:, None, None, :]
            mask = far if mask is None else mask + far
        self._window_masks[window] = mask
        return mask


@dataclass
class DecodeBatch:
    """The sequences with one new token, served from their persistent dense rows
    (`DecodeRows`), one attention call per length-class group."""

    tokens: torch.Tensor | None  # int64 [n] flat index of each token; None = the whole batch
    groups: list[DecodeGroup]
    fused: bool = False  # attention runs as one compiled op a group (`cpu_fused`)


@dataclass
class AttentionMetadata:
    """Everything attention needs, built once per forward and shared by all layers."""

    slot_blocks: torch.Tensor  # int64 [T] block id of each new token
    slot_offsets: torch.Tensor  # int64 [T] offset inside that block
    decode: DecodeBatch | PoolDecode | None  # PoolDecode: the fused op reads the pool
    prefills: PrefillBatch
    last_token: torch.Tensor | None  # int64 [n] flat index of each sequence's last token; None = all
    # An all-decode step leaves the pool alone layer by layer (attention reads the dense rows)
    # and copies every layer's new K/V into it at once in `finish_step`: one index op a step
    # instead of a stack and an index_put a layer. None: each layer writes its tokens' slots.
    deferred_pool: torch.Tensor | None = None
    # S42: per sequence, the tokens whose blocks a sliding window released (their table entries
    # are the null block 0), and its first query position this step; None = no sequence has
    # any. Every layer that attends must have a window that hides them (`check_released`).
    released_tokens: np.ndarray | None = None
    first_query: np.ndarray | None = None
    _windows_checked: set = field(default_factory=set)

    def check_released(self, window: int | None) -> None:
        """Assert that no query of this step can see a released block under `window`: the
        scheduler releases only blocks behind every window still to come (docs/scheduler.md
        S42), so one that a query could see would be read as the null block's zeros."""
        if self.released_tokens is None or window in self._windows_checked:
            return
        assert window is not None, \
            "a full-attention layer over a block table with released blocks (S42)"
        visible = (self.released_tokens > 0) & \
            (self.released_tokens > self.first_query + 1 - window)
        assert not visible.any(), (
            f"released blocks inside the window {window}: released tokens "
            f"{self.released_tokens[visible][:4]}, first queries {self.first_query[visible][:4]}")
        self._windows_checked.add(window)


def build_decode(seqlens_q: np.ndarray, seqlens_k: np.ndarray, starts: np.ndarray,
                 seq_ids: np.ndarray, block_tables: torch.Tensor, kv_cache: torch.Tensor,
                 decode_rows: DecodeRows, dtype: torch.dtype,
                 keep: np.ndarray | None = None) -> DecodeBatch | None:
    """`keep`: the sequences verifying drafts this step, whose rows stay for their next."""
    dec = np.flatnonzero(seqlens_q == 1)
    if len(dec) == 0:
        return None
    device = block_tables.device
    lens = seqlens_k[dec]
    is_all = len(dec) == len(seqlens_q)
    tables = block_tables if is_all else block_tables[torch.as_tensor(dec, device=device)]
    groups = []
    prepared = decode_rows.prepare(seq_ids[dec], lens, tables, kv_cache, kv_cache.shape[3], keep)
    for group, index, rows in prepared:
        glens = lens[index]
        n, max_len = len(index), int(glens.max())
        num_rows = int(rows.max()) + 1  # n, unless kept rows lie among the entries'
        identity = num_rows == n and bool((rows == torch.arange(n, device=device)).all())
        lens_t = torch.as_tensor(glens, device=device)
        row_lens = lens_t if identity else \
            lens_t.new_full((num_rows,), max_len).index_copy_(0, rows, lens_t)
        mask = None
        if int(glens.min()) < max_len:
            mask = torch.zeros((num_rows, max_len), dtype=dtype, device=device)
            mask.masked_fill_(torch.arange(max_len, device=device)[None, :] >= row_lens[:, None],
                              float("-inf"))
            mask = mask[:, None, None, :]
        groups.append(DecodeGroup(
            group, None if len(prepared) == 1 else torch.as_tensor(index, device=device), rows,
            None if identity else rows, lens_t - 1, glens, mask,
            group.ws[:, :, :num_rows, :, :max_len], dtype))
    tokens = None if is_all else torch.as_tensor(starts[dec], device=device)
    return DecodeBatch(tokens, groups)


def build_metadata(batch: StepBatch, seq_ids: np.ndarray, kv_cache: torch.Tensor,
                   decode_rows: DecodeRows | None, dtype: torch.dtype) -> AttentionMetadata:
    """`decode_rows` None: decode tokens read the pool (`PoolDecode`), no dense rows."""
    seqlens_q, seqlens_k, block_tables = batch.seqlens_q, batch.seqlens_k, batch.block_tables
    device = block_tables.device
    block_size = kv_cache.shape[3]
    starts = np.concatenate([[0], np.cumsum(seqlens_q)[:-1]]).astype(np.int64)
    if decode_rows is None:
        decode = build_pool_decode(seqlens_q, seqlens_k, starts, block_tables, kv_cache)
    else:
        chunks = seqlens_q > 1
        keep = None
        if batch.decode_step:  # verified drafts: their rows keep the tokens before the chunk
            keep = seq_ids[chunks]
            decode_rows.truncate(keep, (seqlens_k - seqlens_q)[chunks])
        else:  # their K/V is being (re)written by a prefill
            decode_rows.forget(seq_ids[chunks])
        decode = build_decode(seqlens_q, seqlens_k, starts, seq_ids, block_tables, kv_cache,
                              decode_rows, dtype, keep)
    prefills = build_prefill(seqlens_q, seqlens_k, starts, block_tables, block_size)
    last = None  # an all-decode batch: every token is its sequence's last
    if decode is None or decode.tokens is not None:
        last = torch.as_tensor(starts + seqlens_q - 1, device=device)
    slots = batch.slot_mapping
    deferred = kv_cache if decode_rows is not None and decode is not None \
        and decode.tokens is None else None
    released = released_tokens(block_tables, block_size)
    return AttentionMetadata(slots // block_size, slots % block_size, decode, prefills, last,
                             deferred, released,
                             None if released is None else seqlens_k - seqlens_q)


def released_tokens(block_tables: torch.Tensor, block_size: int) -> np.ndarray | None:
    """Tokens per row whose blocks the sliding window released (S42): the leading run of null
    entries (a live table's first entry is 0 only then); None when no row has one."""
    if block_tables.shape[1] == 0:
        return None
    # numpy on the CPU (a view): ~2 us a step, where the same test in torch ops took ~25
    tables = block_tables.numpy() if block_tables.device.type == "cpu" else None
    if (tables[:, 0] if tables is not None else block_tables[:, 0].cpu().numpy()).all():
        return None
    leading = (block_tables == 0).to(torch.int32).cumprod(dim=1).sum(dim=1)
    return leading.cpu().numpy().astype(np.int64) * block_size


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     d: DecodeBatch | PoolDecode, layer: int,
                     options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
    """Attention of all single-token sequences, one call per row group (or one over the pool);
    returns [n, Hq, D]."""
    if d.tokens is not None:
        q, k, v = q[d.tokens], k[d.tokens], v[d.tokens]
    if isinstance(d, PoolDecode):  # rotated already (a step with prefills, or a Q/K norm)
        assert options.is_plain, "a layer with attention options over the pool op (set_model)"
        qkv = torch.cat((q.flatten(1), k.flatten(1).to(q.dtype), v.flatten(1).to(q.dtype)), dim=1)
        return pool_attention(qkv, None, None, d, layer, q.shape[1]).view_as(q)
    if d.fused and options.is_plain:  # rotated already (a step with prefills): the op takes the rows as they are
        # (k, v arrive rounded to a bf16 pool's dtype: exact in fp32, the op rounds them back.)
        qkv = torch.cat((q.flatten(1), k.flatten(1).to(q.dtype), v.flatten(1).to(q.dtype)), dim=1)
        return fused_groups(qkv, None, None, d, layer, q.shape[1], k.shape[1]).view_as(q)
    if len(d.groups) == 1:
        return group_attention(q, k, v, d.groups[0], layer, options)
    out = torch.empty_like(q)
    for g in d.groups:
        out[g.index] = group_attention(q[g.index], k[g.index], v[g.index], g, layer, options)
    return out


def fused_groups(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 d: DecodeBatch, layer: int, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """`cpu_fused.decode_attention` over each row group of a decode batch: [n, Hq D]."""
    if len(d.groups) == 1:
        g = d.groups[0]
        return cpu_fused.decode_attention(qkv, cos, sin, g.group.ws, layer, g.rows, g.new_pos,
                                          num_heads, num_kv_heads)
    out = qkv.new_empty((qkv.shape[0], num_heads * qkv.shape[1] // (num_heads + 2 * num_kv_heads)))
    for g in d.groups:
        out[g.index] = cpu_fused.decode_attention(
            qkv[g.index], None if cos is None else cos[g.index],
            None if sin is None else sin[g.index], g.group.ws, layer, g.rows, g.new_pos,
            num_heads, num_kv_heads)
    return out


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: DecodeGroup,
                    layer: int, options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    dense = g.kv[layer]  # [2, n, Hkv, max_len, D]
    # Advanced indices on dims 1 and 3 around a slice: the indexed view is [n, 2, Hkv, D].
    dense[:, g.rows, :, g.new_pos] = torch.stack((k, v), dim=1)
    # The query heads sharing a KV head ride as its query rows: no K/V repeat, no copy.
    qd = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if g.permutation is not None:  # zeros for a kept row that is no entry's (its output dropped)
        qd = (torch.empty_like(qd) if g.kv.shape[2] == n else
              qd.new_zeros((g.kv.shape[2], *qd.shape[1:]))).index_copy_(0, g.permutation, qd)
    keys, vals = dense[0], dense[1]  # [n, Hkv, max_len, D]
    if keys.dtype != q.dtype:  # rows in another KV dtype: attention runs in the compute dtype
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
    mask = g.mask if options.window is None else g.window_mask(options.window)
    if keys.shape[2] <= _MATH_ATTENTION_MAX_LEN or options.softcap is not None:
        # Two batched GEMMs and a softmax: for short contexts the fused CPU kernel's own
        # overhead dominates (batch 32 x 80 tokens: 221 vs 364 us a layer on 2 threads).
        # Soft-capping (which SDPA cannot express) takes this path at any length.
        scale = head_dim ** -0.5 if options.scale is None else options.scale
        scores = torch.matmul(qd, keys.transpose(-1, -2)).mul_(scale)
        if options.softcap is not None:
            scores.div_(options.softcap).tanh_().mul_(options.softcap)
        if mask is not None:
            scores.add_(mask)
        out = torch.matmul(scores.softmax(-1), vals)
    else:
        out = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=mask, scale=options.scale)
    if g.permutation is not None:
        out = out[g.permutation]
    return out.reshape(n, num_heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                    meta: AttentionMetadata, layer: int,
                    options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
    """Attention of each new token over its sequence's cached + new K/V. q [T, Hq, D]."""
    d = meta.decode
    if d is not None and d.tokens is None:
        return decode_attention(q, k, v, d, layer, options)
    out = torch.empty_like(q)
    if d is not None:
        out[d.tokens] = decode_attention(q, k, v, d, layer, options)
    prefill_attention(q, k, v, layer_kv, meta.prefills, out, options)
    return out


class CPUBackend:
    """The CPU backend (`baton/model/backends/base.py` says what a backend provides)."""

    name = "cpu"

    def __init__(self, fused_decode: bool = False, kernel_rows: str = "decode",
                 decode_kv: str = "pool") -> None:
        """`fused_decode`: decode attention as one compiled op a layer (`cpu_fused`; not the
        eager path's float operations, so only for modes that are not the exact one).
        `kernel_rows`: which rows a quantized weight multiplies with its block kernel: "decode"
        (decode tokens; prefill chunks take the dense copy) or "all" (the quality gate's
        teacher forcing measures the kernels' numbers through prefill chunks).
        `decode_kv`: what the fused op reads a decoding sequence's K/V from: "pool" (its blocks,
        through its block table; the engine's default) or "rows" (dense rows beside the pool:
        the pool op's reference, the same tokens for twice the memory;
        tests/model/test_pool_decode.py and bench/decode_step.py --decode-kv compare the
        two). Without `fused_decode` (the exact mode) rows serve either way."""
        if kernel_rows not in ("decode", "all"):
            raise ValueError(f"kernel_rows must be 'decode' or 'all', got {kernel_rows!r}")
        if decode_kv not in ("pool", "rows"):
            raise ValueError(f"decode_kv must be 'pool' or 'rows', got {decode_kv!r}")
        self.decode_rows = DecodeRows()  # decode K/V, kept across steps (when not pool_decode)
        self.fused_decode = fused_decode and cpu_fused.AVAILABLE
        self.kernel_rows = kernel_rows
        self.decode_kv = decode_kv
        # Until `set_model` says otherwise: each decoding sequence's K/V is mirrored in its
        # dense row, up to the pool's size again.
        self.pool_decode = False
        self.kv_memory_factor = 1.0
        self._model_dtypes: tuple[torch.dtype, torch.dtype] | None = None
        self._decode_token = np.zeros(0, dtype=bool)  # this step's flat tokens: a decode row?
        self._all_decode = False  # every token of this step is a decode row

    def set_model(self, options: Sequence[AttentionOptions], dtype: torch.dtype,
                  kv_dtype: torch.dtype) -> None:
        """Decode steps read the pool (no dense rows, `kv_memory_factor` 0) when the fused op
        serves every layer: `decode_kv="pool"`, plain attention on every layer, float32 compute
        over a pool the op reads (float32, bfloat16); dense rows otherwise (factor 1)."""
        self.pool_decode = bool(self.fused_decode and self.decode_kv == "pool"
                                and dtype == torch.float32 and kv_dtype in cpu_fused.ROW_DTYPES
                                and all(o.is_plain for o in options))
        self.kv_memory_factor = 0.0 if self.pool_decode else 1.0
        self._model_dtypes = (dtype, kv_dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return self._quantized(x, weight, self._decode_token, linear)
        return linear(x, weight)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            flags = self._decode_token if rows is None else self._decode_token[rows.cpu().numpy()]
            return self._quantized(x, weight, flags, lm_head)
        return lm_head(x, weight)

    def _quantized(self, x: torch.Tensor, weight: QuantizedWeight, decode: np.ndarray,
                   dense) -> torch.Tensor:
        """Decode rows through the block kernel, prefill rows through the dense copy, chosen by
        the kind of row, never by the batch's size: a decode token's numbers are the same
        whatever else its step holds (disaggregated == co-located under any load)."""
        if self.kernel_rows == "all" or len(decode) != x.shape[0] or \
                (self._all_decode if decode is self._decode_token else decode.all()):
            return weight.matmul(x)
        out = dense(x, weight)
        if decode.any():
            index = torch.as_tensor(np.flatnonzero(decode), device=x.device)
            out[index] = weight.matmul(x[index])
        return out

    def prepare(self, batch: StepBatch, kv_cache: torch.Tensor,
                dtype: torch.dtype) -> AttentionMetadata:
        # A verified draft is a decode token for the weights (the block kernels, whose rows
        # do not depend on each other, give it a plain decode step's numbers); its attention
        # runs as a short chunk over the pool (the dense rows hold one new token a step).
        self._decode_token = np.ones(int(batch.seqlens_q.sum()), dtype=bool) \
            if batch.decode_step else np.repeat(batch.seqlens_q == 1, batch.seqlens_q)
        self._all_decode = bool(self._decode_token.all())
        if self.pool_decode:
            assert (dtype, kv_cache.dtype) == self._model_dtypes, \
                f"a step in {dtype} over a {kv_cache.dtype} pool; set_model said {self._model_dtypes}"
            return build_metadata(batch, np.zeros(0, dtype=np.int64), kv_cache, None, dtype)
        seq_ids = batch.seq_ids
        if seq_ids is None:
            self.decode_rows.reset()  # no identities: nothing may be matched across steps
            seq_ids = np.arange(len(batch.seqlens_q))
        meta = build_metadata(batch, seq_ids, kv_cache, self.decode_rows, dtype)
        if meta.decode is not None and self.fused_decode and dtype == torch.float32 \
                and kv_cache.dtype in cpu_fused.ROW_DTYPES:
            meta.decode.fused = True
        return meta

    @staticmethod
    def fused_attention(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                        meta: AttentionMetadata, layer: int) -> torch.Tensor | None:
        d = meta.decode
        if d is None or not d.fused or d.tokens is not None:
            return None  # a step with prefills: the eager path rotates every token
        meta.check_released(None)  # plain attention reads every block (S42)
        if isinstance(d, PoolDecode):
            num_heads = qkv.shape[1] // d.pool.shape[5] - 2 * d.pool.shape[4]
            return pool_attention(qkv, cos[:, 0], signed_sin[:, 0], d, layer, num_heads)
        ws = d.groups[0].group.ws
        num_kv_heads, head_dim = ws.shape[3], ws.shape[5]
        num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
        return fused_groups(qkv, cos[:, 0], signed_sin[:, 0], d, layer, num_heads, num_kv_heads)

    def fused_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.fused_decode or x.dtype != torch.float32 or weight.dtype != torch.float32:
            return None
        return cpu_fused.rms_norm(x.contiguous(), weight, eps,
                                  None if residual is None else residual.contiguous())

    def fused_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        if not self.fused_decode or gate_up.dtype != torch.float32:
            return None
        return cpu_fused.silu_mul(gate_up.contiguous())

    @staticmethod
    def last_tokens(meta: AttentionMetadata) -> torch.Tensor | None:
        return meta.last_token

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                  meta: AttentionMetadata, layer: int,
                  options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
        if k.dtype != layer_kv.dtype:
            # A KV dtype other than the compute dtype: the new K/V are rounded to it before
            # anything reads them, so a chunk attends over the same numbers whether they come
            # from this step, the pool (a prefix hit, a pulled prompt) or a decode row.
            k, v = k.to(layer_kv.dtype), v.to(layer_kv.dtype)
        meta.check_released(options.window)
        if meta.deferred_pool is None:
            # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T, 2, H, D].
            layer_kv[meta.slot_blocks, :, meta.slot_offsets] = torch.stack((k, v), dim=1)
        return paged_attention(q, k, v, layer_kv, meta, layer, options)

    @staticmethod
    def finish_step(meta: AttentionMetadata) -> None:
        if meta.decode is None or isinstance(meta.decode, PoolDecode):
            return  # the op wrote each new token into its pool slot
        for g in meta.decode.groups:  # every layer wrote this step's token into the rows
            if meta.deferred_pool is not None:
                blocks, offsets = meta.slot_blocks, meta.slot_offsets
                if g.index is not None:
                    blocks, offsets = blocks[g.index], offsets[g.index]
                # ws [L, 2, rows, Hkv, cap, D] at (row, position) of each entry: [n, L, 2, Hkv,
                # D], the shape of the pool [blocks, L, 2, B, Hkv, D] at (block, offset).
                meta.deferred_pool[blocks, :, :, offsets] = g.group.ws[:, :, g.rows, :, g.new_pos]
            g.group.commit(g.rows, g.lens)


class PortableBackend(CPUBackend):
    """Plain torch ops on any device (CUDA included): the CPU backend's attention without its
    CPU-only GEMM tricks. Not tuned: a CUDA backend (paged flash attention, no dense rows)
    replaces it; these machines have no GPU to build and measure one on."""

    name = "portable"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return portable_linear(x, weight)

    @staticmethod
    def lm_head(x: torch.Tensor, weight: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        return portable_linear(x, weight)
