"""Llama-family decoder over a paged KV pool: one forward for prefill chunks and batched decode.

The batch is flat: the tokens of all scheduled sequences one after another, as the scheduler's
`SchedulerOutputs` gives them. Per layer, every new token's K/V is first written into the pool at
its slot, then attention reads the pool through the block tables:
  * sequences with one query token (decode) are served together: their blocks are gathered into
    a padded [n, max_len] K/V tensor and one masked `scaled_dot_product_attention` call runs;
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

logger = logging.getLogger(__name__)

ArrayLike = torch.Tensor | np.ndarray | list


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics whatever the activation dtype, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_table(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_position, head_dim]` in fp32 (HF's non-interleaved "rotate_half" layout)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    pos = torch.arange(config.max_position, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


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
class AttentionMetadata:
    """Everything attention needs, built once per forward and shared by all layers."""

    slot_blocks: torch.Tensor  # int64 [T] block id of each new token
    slot_offsets: torch.Tensor  # int64 [T] offset inside that block
    decode_tokens: torch.Tensor | None  # int64 [nd] flat index of each single-token sequence
    decode_tables: torch.Tensor | None  # int64 [nd, max_blocks]
    decode_mask: torch.Tensor | None  # bool [nd, 1, 1, max_blocks*block_size]
    prefills: list[PrefillSlice]
    last_token: torch.Tensor  # int64 [n] flat index of each sequence's last token


def build_metadata(slot_mapping: torch.Tensor, seqlens_q: list[int], seqlens_k: list[int],
                   block_tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    device = block_tables.device
    starts = np.concatenate([[0], np.cumsum(seqlens_q)[:-1]]).astype(np.int64)
    dec = [i for i, q in enumerate(seqlens_q) if q == 1]
    decode_tokens = decode_tables = decode_mask = None
    if dec:
        max_k = max(seqlens_k[i] for i in dec)
        nb = -(-max_k // block_size)
        idx = torch.tensor(dec, dtype=torch.int64, device=device)
        decode_tokens = torch.as_tensor(starts[dec], device=device)
        decode_tables = block_tables[idx, :nb]
        lens = torch.tensor([seqlens_k[i] for i in dec], device=device)
        decode_mask = (torch.arange(nb * block_size, device=device)[None, :] < lens[:, None])
        decode_mask = decode_mask[:, None, None, :]
    prefills = []
    for i, (q, k) in enumerate(zip(seqlens_q, seqlens_k, strict=False)):
        if q <= 1:
            continue
        cached = k - q
        mask = None
        if cached:
            rows = torch.arange(q, device=device)[:, None] + cached
            mask = torch.arange(k, device=device)[None, :] <= rows
        nb = -(-k // block_size)
        prefills.append(PrefillSlice(int(starts[i]), q, k, nb, block_tables[i, :nb], mask))
    last = torch.as_tensor(starts + np.asarray(seqlens_q, dtype=np.int64) - 1, device=device)
    return AttentionMetadata(slot_mapping // block_size, slot_mapping % block_size,
                             decode_tokens, decode_tables, decode_mask, prefills, last)


class LlamaLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + swiglu(norm(x)). Q/K/V and gate/up are fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=c.dtype), requires_grad=False)  # noqa: E731
        self.input_norm = empty(c.hidden_size)
        self.qkv_proj = empty(qkv_rows, c.hidden_size)
        self.o_proj = empty(c.hidden_size, c.num_heads * c.head_dim)
        self.post_norm = empty(c.hidden_size)
        self.gate_up_proj = empty(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = empty(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layer_kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = F.linear(h, self.qkv_proj)
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :nq].view(-1, c.num_heads, c.head_dim)
        k = qkv[:, nq:nq + nk].view(-1, c.num_kv_heads, c.head_dim)
        v = qkv[:, nq + nk:].view(-1, c.num_kv_heads, c.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T, 2, H, D].
        layer_kv[meta.slot_blocks, :, meta.slot_offsets] = torch.stack((k, v), dim=1)
        attn = paged_attention(q, k, v, layer_kv, meta, c)
        x = x + F.linear(attn.reshape(x.shape[0], -1), self.o_proj)
        h = rms_norm(x, self.post_norm, c.rms_norm_eps)
        gate, up = F.linear(h, self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                    meta: AttentionMetadata, c: ModelConfig) -> torch.Tensor:
    """Attention of each new token over its sequence's cached + new K/V. q [T, Hq, D]."""
    out = torch.empty_like(q)
    block_size = layer_kv.shape[2]
    group = c.num_queries_per_kv
    if meta.decode_tokens is not None:
        nd = meta.decode_tokens.shape[0]
        kv = layer_kv[meta.decode_tables]  # [nd, nb, 2, B, Hkv, D]
        keys = kv[:, :, 0].reshape(nd, -1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        vals = kv[:, :, 1].reshape(nd, -1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        # The `group` query heads sharing a KV head ride as its query rows: no K/V repeat.
        qd = q[meta.decode_tokens].view(nd, c.num_kv_heads, group, c.head_dim)
        od = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=meta.decode_mask)
        out[meta.decode_tokens] = od.reshape(nd, c.num_heads, c.head_dim)
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
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.empty(c.hidden_size, dtype=c.dtype), requires_grad=False)
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, dtype=c.dtype), requires_grad=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

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
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one flat batch; write its K/V into `kv_cache`; return fp32 logits [n, vocab] of the
        last token of each sequence. `seqlens_k` is each sequence's context length after the step,
        `slot_mapping` is block_id * block_size + offset for each token of `input_ids`."""
        dev = self.device
        if self._rope is None:
            self._rope = rope_table(self.config, dev)
        ids = torch.as_tensor(np.asarray(input_ids), device=dev).long()
        pos = torch.as_tensor(np.asarray(positions), device=dev).long()
        slots = torch.as_tensor(np.asarray(slot_mapping), device=dev).long()
        tables = torch.as_tensor(np.asarray(block_tables), device=dev).long()
        q_lens = [int(x) for x in np.asarray(seqlens_q)]
        k_lens = [int(x) for x in np.asarray(seqlens_k)]
        assert sum(q_lens) == ids.shape[0] == pos.shape[0] == slots.shape[0], "ragged batch"
        meta = build_metadata(slots, q_lens, k_lens, tables, kv_cache.shape[3])
        cos = self._rope[0][pos][:, None, :].to(self.config.dtype)
        sin = self._rope[1][pos][:, None, :].to(self.config.dtype)
        x = F.embedding(ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i], meta)
        x = rms_norm(x[meta.last_token], self.norm, self.config.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(x, head).float()
