"""Llama-family decoder: the math only, over a paged KV pool.

The batch is flat: the tokens of all scheduled sequences one after another, as the scheduler's
`SchedulerOutputs` gives them (the model runner turns them into tensors, `StepBatch`). Per layer:
norm, fused QKV projection, RoPE, attention (the backend writes the new K/V into the pool and
attends over each sequence's context), output projection, norm, SwiGLU MLP. GEMMs and attention
go through a `Backend` (`baton/model/backends/`): everything device-specific lives there. Only
the last token of each sequence goes through the final norm and the LM head.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.backends.base import Backend
from baton.model.config import ModelConfig

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same math in one call (ATen's composite: bit-identical to the lines below in fp32,
        # tested), instead of eight dispatches of a few microseconds each, twice a layer.
        return torch.rms_norm(x, weight.shape, weight, eps)
    # fp32 statistics whatever the activation dtype, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: Backend,
         residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)); residual None: (x, rms_norm(x)). Through the
    backend's fused kernel where it has one (`Backend.fused_norm`), else the eager ops."""
    fused = backend.fused_norm(x, weight, eps, residual)
    if fused is not None:
        return fused
    if residual is not None:
        x = x + residual
    return x, rms_norm(x, weight, eps)


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
                layer_kv: torch.Tensor, meta: Any, backend: Backend) -> torch.Tensor:
        c = self.config
        h = norm(x, self.input_norm, c.rms_norm_eps, backend)[1]
        qkv = backend.linear(h, self.qkv_proj)
        # A backend may run RoPE, the K/V write and attention as one kernel (a decode step).
        attn = backend.fused_attention(qkv, cos, signed_sin, meta, self.index)
        if attn is None:
            num_qk_heads = c.num_heads + c.num_kv_heads
            # Q and K heads are rotated together; V is a view of the projection.
            qk = apply_rope(qkv[:, :num_qk_heads * c.head_dim].view(-1, num_qk_heads, c.head_dim),
                            cos, signed_sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, num_qk_heads * c.head_dim:].view(-1, c.num_kv_heads, c.head_dim)
            attn = backend.attention(q, k, v, layer_kv, meta, self.index)
        x, h = norm(x, self.post_norm, c.rms_norm_eps, backend,
                    residual=backend.linear(attn.reshape(x.shape[0], -1), self.o_proj))
        gate_up = backend.linear(h, self.gate_up_proj)
        act = backend.fused_silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return x + backend.linear(act, self.down_proj)


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

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None:
            cos, sin = rope_table(self.config, self.device)
            half = self.config.head_dim // 2
            self._rope = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return self._rope

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, backend: Backend, logit_rows: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Run one flat batch (int64 token ids and positions on the model's device); the
        backend writes its K/V into `kv_cache`. Returns fp32 logits [n, vocab] of the last
        token of each sequence (`backend.last_tokens(meta)`), or of the flat token indices
        `logit_rows` (prompt logprobs need a prompt's every position)."""
        c = self.config
        rope_cos, rope_sin = self._rope_table()
        cos = rope_cos[positions][:, None, :].to(c.dtype)
        sin = rope_sin[positions][:, None, :].to(c.dtype)
        x = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i], meta, backend)
        last = backend.last_tokens(meta) if logit_rows is None else logit_rows
        if last is not None:
            x = x[last]
        x = norm(x, self.norm, c.rms_norm_eps, backend)[1]
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return backend.lm_head(x, head, last).float()
