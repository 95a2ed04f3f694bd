"""Gemma 2: a pre- and post-norm ("sandwich") decoder over the shared layers.

    x = x + norm(attn(norm(x)))      post_attention_layernorm after attention
    x = x + norm(mlp(norm(x)))       pre_ and post_feedforward_layernorm around the MLP

Its RMSNorms scale by (1 + weight): the loader stores 1 + weight (in fp32, as transformers
computes it) so the shared norm runs unchanged. Attention scores are scaled by
query_pre_attn_scalar ** -0.5 and soft-capped (tanh), layers alternate sliding-window and full
attention (`layer_types`), the MLP is GELU(tanh)-gated, the embedding is scaled by
sqrt(hidden_size) and the final logits are soft-capped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from baton.model.backends.base import Backend
from baton.model.config import ModelConfig, layer_windows
from baton.model.layers import DecoderLayer, DecoderModel, norm, weight
from baton.model.llama import load_attention, load_mlp
from baton.model.weights import copy_weight, take


class Gemma2Layer(DecoderLayer):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__(config, index)
        self.pre_ff_norm = weight(config, config.hidden_size)
        self.post_ff_norm = weight(config, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                layer_kv: torch.Tensor, meta: Any, backend: Backend) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        h = norm(x, self.input_norm, eps, backend)[1]
        h = self.attention(h, cos, signed_sin, layer_kv, meta, backend)
        x, h = norm(x, self.pre_ff_norm, eps, backend,
                    residual=norm(h, self.post_norm, eps, backend)[1])
        return x + norm(self.mlp(h, backend), self.post_ff_norm, eps, backend)[1]


class Gemma2Model(DecoderModel):
    layer_class = Gemma2Layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # transformers rounds sqrt(hidden) to the activation dtype before the product
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=self.config.dtype)
        return F.embedding(input_ids, self.embed_tokens) * scale.to(self.device)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gemma2_config(raw: dict) -> dict:
    if raw.get("attention_bias"):
        raise ValueError("attention biases are not supported")
    num_layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)]
    return {"hidden_act": raw.get("hidden_activation") or raw.get("hidden_act", "gelu_pytorch_tanh"),
            "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": raw.get("attn_logit_softcapping"),
            "final_softcap": raw.get("final_logit_softcapping"),
            "layer_windows": layer_windows(types, raw.get("sliding_window")),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}


def norm_weight(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A Gemma norm as the shared norm runs it: 1 + weight, in fp32 (as transformers)."""
    return take(weights, name).float() + 1.0


def load_weights(model: DecoderModel, weights: dict[str, torch.Tensor]) -> None:
    copy_weight(model.embed_tokens, take(weights, "model.embed_tokens.weight"), "embed_tokens")
    copy_weight(model.norm, norm_weight(weights, "model.norm.weight"), "norm")
    if model.lm_head is not None:
        copy_weight(model.lm_head, take(weights, "lm_head.weight"), "lm_head")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        load_attention(layer, weights, p)
        load_mlp(layer, weights, p)
        for attr, name in (("input_norm", "input_layernorm"),
                           ("post_norm", "post_attention_layernorm"),
                           ("pre_ff_norm", "pre_feedforward_layernorm"),
                           ("post_ff_norm", "post_feedforward_layernorm")):
            copy_weight(getattr(layer, attr), norm_weight(weights, f"{p}{name}.weight"),
                        f"{p}{name}")
