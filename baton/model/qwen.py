"""Qwen2 / Qwen2.5 (Q/K/V bias), Qwen3 (per-head Q/K RMSNorm) and Qwen3-MoE (Qwen3 attention,
top-k routed SwiGLU experts): the pre-norm decoder of `layers.py` with the config's extras
(`ModelConfig.attention_bias`, `qk_norm`, `num_experts`); checkpoint names are Llama's plus
the biases, the Q/K norms and the experts."""

from __future__ import annotations

import torch

from baton.model.backends.base import Backend
from baton.model.config import ModelConfig, layer_windows
from baton.model.layers import DecoderLayer, DecoderModel, SparseMoE
from baton.model.llama import load_attention, load_common, load_mlp, load_norms
from baton.model.weights import copy_weight, take


class QwenModel(DecoderModel):
    """Qwen2 / Qwen2.5 / Qwen3 (dense)."""

    layer_class = DecoderLayer


class MoELayer(DecoderLayer):
    """A pre-norm block whose MLP is a `SparseMoE` on the config's sparse layers."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        sparse = config.is_sparse(index)
        super().__init__(config, index, dense_mlp=not sparse)
        self.moe = SparseMoE(config) if sparse else None

    def mlp(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        return super().mlp(h, backend) if self.moe is None else self.moe(h, backend)


class Qwen3MoeModel(DecoderModel):
    layer_class = MoELayer


def load_experts(moe: SparseMoE, weights: dict[str, torch.Tensor], p: str) -> None:
    """Router and experts of `p`mlp: per-expert gate/up/down tensors (the published
    checkpoints) or the stacked `experts.gate_up_proj` / `experts.down_proj` that newer
    transformers may write."""
    copy_weight(moe.router, take(weights, f"{p}mlp.gate.weight"), f"{p}mlp.gate")
    if f"{p}mlp.experts.gate_up_proj" in weights:
        copy_weight(moe.gate_up, weights[f"{p}mlp.experts.gate_up_proj"], f"{p}experts.gate_up")
        copy_weight(moe.down, take(weights, f"{p}mlp.experts.down_proj"), f"{p}experts.down")
        return
    e = f"{p}mlp.experts."
    gate_up = [torch.cat([take(weights, f"{e}{i}.{n}_proj.weight") for n in ("gate", "up")])
               for i in range(moe.router.shape[0])]
    copy_weight(moe.gate_up, torch.stack(gate_up), f"{p}experts.gate_up")
    down = [take(weights, f"{e}{i}.down_proj.weight") for i in range(moe.router.shape[0])]
    copy_weight(moe.down, torch.stack(down), f"{p}experts.down")


def load_moe_weights(model: DecoderModel, weights: dict[str, torch.Tensor]) -> None:
    load_common(model, weights)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_attention(layer, weights, p)
        if layer.moe is None:
            load_mlp(layer, weights, p)
        else:
            load_experts(layer.moe, weights, p)
        load_norms(layer, weights, p)


def qwen_windows(raw: dict) -> tuple[int | None, ...]:
    """Per-layer windows: the config's `layer_types` when written, else transformers' rule
    (`use_sliding_window`: the layers from `max_window_layers` on)."""
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if raw.get("layer_types"):
        return layer_windows(raw["layer_types"], raw.get("sliding_window"))
    if window is None:
        return ()
    first = raw.get("max_window_layers", num_layers)
    return tuple(window if i >= first else None for i in range(num_layers))


def qwen2_config(raw: dict) -> dict:
    return {"attention_bias": True, "layer_windows": qwen_windows(raw)}


def qwen3_config(raw: dict) -> dict:
    if raw.get("attention_bias"):
        raise ValueError("Qwen3 attention_bias (biases on every projection) is not supported")
    return {"qk_norm": True, "layer_windows": qwen_windows(raw)}


def qwen3_moe_config(raw: dict) -> dict:
    num_layers = raw["num_hidden_layers"]
    dense = set(raw.get("mlp_only_layers") or [])
    step = raw.get("decoder_sparse_step", 1)
    num_experts = raw.get("num_experts") or raw["num_local_experts"]  # v5 writes the latter
    return {**qwen3_config(raw), "num_experts": num_experts,
            "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["moe_intermediate_size"],
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "sparse_layers": tuple(i not in dense and (i + 1) % step == 0
                                   for i in range(num_layers))}

