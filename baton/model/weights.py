"""Copy HF-named Llama weights into `LlamaModel`'s fused parameters."""

from __future__ import annotations

import torch
from torch import nn


class MissingWeightError(KeyError):
    """A tensor the architecture needs is absent from the checkpoint."""


def _take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise MissingWeightError(name)
    return weights[name]


def _copy(dst: torch.nn.Parameter, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def assign_hf_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Fill every parameter of a `LlamaModel`; MissingWeightError/ValueError on a gap or shape mismatch."""
    _copy(model.embed_tokens, _take(weights, "model.embed_tokens.weight"), "embed_tokens")
    _copy(model.norm, _take(weights, "model.norm.weight"), "norm")
    if model.lm_head is not None:
        _copy(model.lm_head, _take(weights, "lm_head.weight"), "lm_head")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([_take(weights, f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
        _copy(layer.qkv_proj, qkv, f"{p}qkv")
        _copy(layer.o_proj, _take(weights, f"{p}self_attn.o_proj.weight"), f"{p}o_proj")
        gate_up = torch.cat([_take(weights, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")])
        _copy(layer.gate_up_proj, gate_up, f"{p}gate_up")
        _copy(layer.down_proj, _take(weights, f"{p}mlp.down_proj.weight"), f"{p}down_proj")
        _copy(layer.input_norm, _take(weights, f"{p}input_layernorm.weight"), f"{p}input_norm")
        _copy(layer.post_norm, _take(weights, f"{p}post_attention_layernorm.weight"),
              f"{p}post_norm")
