"""Phi-3: the pre-norm Llama layer of `layers.py`; its checkpoint stores Q/K/V as one
`qkv_proj` and gate/up as one `gate_up_proj` (gate rows first), the fused layout Baton runs,
and its config may set a sliding window on every layer."""

from __future__ import annotations

import torch

from baton.model.layers import DecoderLayer, DecoderModel
from baton.model.llama import load_common, load_norms
from baton.model.weights import copy_weight, take


class Phi3Model(DecoderModel):
    layer_class = DecoderLayer


def phi3_config(raw: dict) -> dict:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    window = raw.get("sliding_window")
    return {"layer_windows": (window,) * raw["num_hidden_layers"] if window else ()}


def load_weights(model: DecoderModel, weights: dict[str, torch.Tensor]) -> None:
    load_common(model, weights)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        copy_weight(layer.qkv_proj, take(weights, f"{p}self_attn.qkv_proj.weight"), f"{p}qkv")
        copy_weight(layer.o_proj, take(weights, f"{p}self_attn.o_proj.weight"), f"{p}o_proj")
        copy_weight(layer.gate_up_proj, take(weights, f"{p}mlp.gate_up_proj.weight"),
                    f"{p}gate_up")
        copy_weight(layer.down_proj, take(weights, f"{p}mlp.down_proj.weight"), f"{p}down_proj")
        load_norms(layer, weights, p)
