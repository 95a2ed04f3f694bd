"""The parts every decoder family is built from: norms, RoPE, the attention and MLP halves of a
layer, a sparse mixture of experts, and the decoder around the layers.

The batch is flat: the tokens of all scheduled sequences one after another, as the scheduler's
`SchedulerOutputs` gives them (the model runner turns them into tensors, `StepBatch`). GEMMs and
attention go through a `Backend` (`baton/model/backends/`): everything device-specific lives
there. A family module (`llama.py`, `qwen.py`, `phi3.py`, `gemma2.py`, `gemma3.py`) picks its
layer's order and extras and maps its checkpoint's tensor names onto these parameters.

A layer's projections are flat attributes of the layer (`qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`): the quantized modes replace them by name (`quant.quantize_model`). While a step
serves LoRA adapters, `layer.lora` adds each adapter row's delta after each projection
(`baton/model/lora.py`); it is None otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.backends.base import AttentionOptions, Backend
from baton.model.config import ModelConfig

logger = logging.getLogger(__name__)

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


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


def rope_table(config: ModelConfig, device: torch.device, base: float | None = None,
               factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_position, head_dim]` in fp32 (HF's non-interleaved "rotate_half" layout);
    `base` (default `rope_theta`) and the linear scaling `factor` (HF's "linear" rope type:
    the frequencies divided by it) of a layer (`ModelConfig.rope`)."""
    dim = config.head_dim
    base = config.rope_theta if base is None else base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if factor != 1.0:
        inv_freq = inv_freq / factor
    pos = torch.arange(config.max_position, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` with the sign of rotate_half folded into `signed_sin`
    (negation is exact, so the result is bit-identical) and the two halves swapped by `roll`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def weight(config: ModelConfig, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=config.dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x)). Q/K/V and gate/up are fused; the
    config adds a Q/K/V bias (Qwen2), per-head Q/K RMSNorm (Qwen3) and per-layer attention
    options (scale, soft-capping, sliding window)."""

    def __init__(self, config: ModelConfig, index: int = 0, dense_mlp: bool = True) -> None:
        super().__init__()
        c = config
        self.config = c
        self.index = index
        self.attention_options: AttentionOptions = c.attention_options(index)
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.input_norm = weight(c, c.hidden_size)
        self.qkv_proj = weight(c, qkv_rows, c.hidden_size)
        self.qkv_bias = weight(c, qkv_rows) if c.attention_bias else None
        self.q_norm = weight(c, c.head_dim) if c.qk_norm else None
        self.k_norm = weight(c, c.head_dim) if c.qk_norm else None
        self.o_proj = weight(c, c.hidden_size, c.num_heads * c.head_dim)
        self.post_norm = weight(c, c.hidden_size)
        if dense_mlp:
            self.gate_up_proj = weight(c, 2 * c.intermediate_size, c.hidden_size)
            self.down_proj = weight(c, c.hidden_size, c.intermediate_size)
        self.act = _ACTIVATIONS[c.hidden_act]
        self.lora = None  # a step's LoRA hook (lora.LayerLora), set only for that step

    def attention(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  layer_kv: torch.Tensor, meta: Any, backend: Backend) -> torch.Tensor:
        """o_proj(attention(qkv_proj(h))): [T, hidden]."""
        c = self.config
        qkv = backend.linear(h, self.qkv_proj)
        if self.lora is not None:
            qkv = self.lora(qkv, h, "qkv_proj")
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        attn = None
        if self.q_norm is None and self.attention_options.is_plain:
            # A backend may run RoPE, the K/V write and attention as one kernel (a decode step).
            attn = backend.fused_attention(qkv, cos, signed_sin, meta, self.index)
        if attn is None:
            num_qk_heads = c.num_heads + c.num_kv_heads
            qk = qkv[:, :num_qk_heads * c.head_dim].view(-1, num_qk_heads, c.head_dim)
            if self.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :c.num_heads], self.q_norm, c.rms_norm_eps),
                                rms_norm(qk[:, c.num_heads:], self.k_norm, c.rms_norm_eps)), dim=1)
            # Q and K heads are rotated together; V is a view of the projection.
            qk = apply_rope(qk, cos, signed_sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, num_qk_heads * c.head_dim:].view(-1, c.num_kv_heads, c.head_dim)
            attn = backend.attention(q, k, v, layer_kv, meta, self.index, self.attention_options)
        attn = attn.reshape(h.shape[0], -1)
        out = backend.linear(attn, self.o_proj)
        return out if self.lora is None else self.lora(out, attn, "o_proj")

    def mlp(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        """down_proj(act(gate) * up): [T, hidden]."""
        gate_up = backend.linear(h, self.gate_up_proj)
        if self.lora is not None:
            gate_up = self.lora(gate_up, h, "gate_up_proj")
        act = backend.fused_silu_mul(gate_up) if self.act is F.silu else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.act(gate) * up
        out = backend.linear(act, self.down_proj)
        return out if self.lora is None else self.lora(out, act, "down_proj")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                layer_kv: torch.Tensor, meta: Any, backend: Backend) -> torch.Tensor:
        c = self.config
        h = norm(x, self.input_norm, c.rms_norm_eps, backend)[1]
        x, h = norm(x, self.post_norm, c.rms_norm_eps, backend,
                    residual=self.attention(h, cos, signed_sin, layer_kv, meta, backend))
        return x + self.mlp(h, backend)


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE / Mixtral): softmax over every expert's router logit in
    fp32, the k largest, renormalised to sum 1 when `norm_topk_prob`; each token's output is
    the weighted sum of its experts' SwiGLU MLPs. Experts run one GEMM pair each over the
    tokens routed to them; in the quantized modes `gate_up` and `down` are lists of one block
    weight per expert (`quant.quantize_model`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.router = weight(c, c.num_experts, c.hidden_size)
        self.gate_up = weight(c, c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        self.down = weight(c, c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        c = self.config
        logits = backend.linear(h, self.router)
        probs = logits.softmax(-1, dtype=torch.float32)
        top, experts = probs.topk(c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(h.dtype)
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():
            tokens, slot = torch.where(experts == e)
            gate, up = backend.linear(h[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = backend.linear(self.act(gate) * up, self.down[e])
            out.index_add_(0, tokens, y * top[tokens, slot, None])
        return out


class DecoderModel(nn.Module):
    """Embedding, the family's layers, final norm, LM head. A family sets `layer_class` and,
    where it has them, the embedding scale and the final logit soft-capping."""

    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = weight(c, c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(c, i) for i in range(c.num_layers))
        self.norm = weight(c, c.hidden_size)
        self.lm_head = None if c.tie_word_embeddings else weight(c, c.vocab_size, c.hidden_size)
        # (base, factor) -> cos, signed sin: one table per distinct `ModelConfig.rope` (Gemma 3's
        # local and global layers differ), built on first use
        self._rope: dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._layer_rope = [c.rope(i) for i in range(c.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def _rope_tables(self) -> dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]]:
        if self._rope is None:
            half = self.config.head_dim // 2
            self._rope = {}
            for key in dict.fromkeys(self._layer_rope):
                cos, sin = rope_table(self.config, self.device, *key)
                self._rope[key] = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return self._rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, backend: Backend, logit_rows: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """Run one flat batch (int64 token ids and positions on the model's device); the
        backend writes its K/V into `kv_cache`. Returns fp32 logits [n, vocab] of the last
        token of each sequence (`backend.last_tokens(meta)`), or of the flat token indices
        `logit_rows` (prompt logprobs need a prompt's every position)."""
        c = self.config
        rope = {key: (cos[positions][:, None, :].to(c.dtype),
                      sin[positions][:, None, :].to(c.dtype))
                for key, (cos, sin) in self._rope_tables().items()}
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, *rope[self._layer_rope[i]], kv_cache[:, i], meta, backend)
        last = backend.last_tokens(meta) if logit_rows is None else logit_rows
        if last is not None:
            x = x[last]
        x = norm(x, self.norm, c.rms_norm_eps, backend)[1]
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.final_logits(backend.lm_head(x, head, last).float())
