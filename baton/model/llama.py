"""Llama / SmolLM / Mistral: the plain pre-norm decoder of `layers.py` (no biases, RoPE,
RMSNorm, GQA, SwiGLU); Mistral's sliding window comes in through `ModelConfig.layer_windows`.

Per layer: norm, fused QKV projection, RoPE, attention (the backend writes the new K/V into the
pool and attends over each sequence's context), output projection, norm, SwiGLU MLP. Only the
last token of each sequence goes through the final norm and the LM head.
"""

from __future__ import annotations

import torch

from baton.model.layers import (  # noqa: F401  (re-exported: tests and bench import them here)
    DecoderLayer,
    DecoderModel,
    apply_rope,
    norm,
    rms_norm,
    rope_table,
)
from baton.model.weights import copy_weight, take

LlamaLayer = DecoderLayer


class LlamaModel(DecoderModel):
    """Llama / SmolLM / Mistral-style decoder."""

    layer_class = DecoderLayer


def load_common(model: DecoderModel, weights: dict[str, torch.Tensor]) -> None:
    """Embedding, final norm and untied head under their HF names (every family's)."""
    copy_weight(model.embed_tokens, take(weights, "model.embed_tokens.weight"), "embed_tokens")
    copy_weight(model.norm, take(weights, "model.norm.weight"), "norm")
    if model.lm_head is not None:
        copy_weight(model.lm_head, take(weights, "lm_head.weight"), "lm_head")


def load_attention(layer: DecoderLayer, weights: dict[str, torch.Tensor], p: str) -> None:
    """Separate q/k/v(/bias)/o projections and the Q/K norms of `p`self_attn."""
    qkv = torch.cat([take(weights, f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
    copy_weight(layer.qkv_proj, qkv, f"{p}qkv")
    if layer.qkv_bias is not None:
        bias = torch.cat([take(weights, f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        copy_weight(layer.qkv_bias, bias, f"{p}qkv.bias")
    if layer.q_norm is not None:
        copy_weight(layer.q_norm, take(weights, f"{p}self_attn.q_norm.weight"), f"{p}q_norm")
        copy_weight(layer.k_norm, take(weights, f"{p}self_attn.k_norm.weight"), f"{p}k_norm")
    copy_weight(layer.o_proj, take(weights, f"{p}self_attn.o_proj.weight"), f"{p}o_proj")


def load_mlp(layer: DecoderLayer, weights: dict[str, torch.Tensor], p: str) -> None:
    gate_up = torch.cat([take(weights, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")])
    copy_weight(layer.gate_up_proj, gate_up, f"{p}gate_up")
    copy_weight(layer.down_proj, take(weights, f"{p}mlp.down_proj.weight"), f"{p}down_proj")


def load_norms(layer: DecoderLayer, weights: dict[str, torch.Tensor], p: str) -> None:
    copy_weight(layer.input_norm, take(weights, f"{p}input_layernorm.weight"), f"{p}input_norm")
    copy_weight(layer.post_norm, take(weights, f"{p}post_attention_layernorm.weight"),
                f"{p}post_norm")


def load_weights(model: DecoderModel, weights: dict[str, torch.Tensor]) -> None:
    """Fill every parameter from HF-named tensors; MissingWeightError/ValueError on a gap or
    shape mismatch. Also Qwen2's (biases) and Qwen3's (Q/K norms): the same names."""
    load_common(model, weights)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_attention(layer, weights, p)
        load_mlp(layer, weights, p)
        load_norms(layer, weights, p)
