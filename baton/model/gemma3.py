"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2's sandwich decoder (`gemma2.py`) with

- per-head Q/K RMSNorm before RoPE (`ModelConfig.qk_norm`), Gemma's (1 + weight) norms: the
  loader stores 1 + weight, as for the other norms;
- a RoPE per layer type (`ModelConfig.layer_rope`): the local (sliding-window) layers' base
  (`rope_local_base_freq`, 10000), the global layers' (`rope_theta`, 1e6), each with optional
  "linear" scaling (the global layers' in the larger checkpoints); any other rope type is
  refused by name;
- five local layers to one global (`sliding_window_pattern`, 6) unless `layer_types` says;
- attention and final logit soft-capping off by default (honoured when the config sets them).

Query scale (`query_pre_attn_scalar`), GELU(tanh) MLP and the embedding scaled by
sqrt(hidden_size) are Gemma 2's. Not read from GGUF (`gguf_layout.REFUSED`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.model import gemma2
from baton.model.layers import DecoderModel
from baton.model.weights import copy_weight

LAYER_TYPES = ("sliding_attention", "full_attention")
_DEFAULT_BASES = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}


class Gemma3Model(gemma2.Gemma2Model):
    """Gemma 2's layers (`Gemma2Layer`); the Q/K norms and the per-layer RoPE come with the
    config."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # transformers keeps sqrt(hidden) as an fp32 tensor and casts it to the weights' dtype
        scale = torch.tensor(self.config.hidden_size ** 0.5).to(self.config.dtype)
        return F.embedding(input_ids, self.embed_tokens) * scale.to(self.device)


def rope_by_type(raw: dict) -> dict[str, tuple[float, float]]:
    """layer type -> (RoPE base, linear factor), as transformers' `Gemma3TextConfig` reads
    them: `rope_parameters` per layer type (transformers 5), else the older keys (`rope_theta`
    and `rope_scaling` for the global layers, `rope_local_base_freq` for the local ones)."""
    given = raw.get("rope_parameters") or {}
    if given and not set(given) <= set(LAYER_TYPES):
        raise ValueError(f"rope_parameters {given} is not per layer type {LAYER_TYPES}")
    params = {t: dict(given.get(t) or {}) for t in LAYER_TYPES}
    if raw.get("rope_scaling"):
        params["full_attention"].update(raw["rope_scaling"])
    params["full_attention"].setdefault("rope_theta", raw.get("rope_theta"))
    params["sliding_attention"].setdefault("rope_theta", raw.get("rope_local_base_freq"))
    out = {}
    for layer_type, p in params.items():
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(f"unsupported rope scaling {kind!r} on the {layer_type} layers "
                             f"({p}); default and linear are supported")
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        base = p["rope_theta"] if p["rope_theta"] is not None else _DEFAULT_BASES[layer_type]
        out[layer_type] = (float(base), float(p["factor"]) if kind == "linear" else 1.0)
    return out


def gemma3_config(raw: dict) -> dict:
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (non-causal, EmbeddingGemma) is not "
                         "supported")
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(raw["num_hidden_layers"])]
    rope = rope_by_type(raw)
    return {**gemma2.gemma2_config({**raw, "layer_types": types}), "qk_norm": True,
            "head_dim": raw.get("head_dim") or 256,  # transformers' default, not hidden/heads
            "rope_theta": rope["full_attention"][0],
            "layer_rope": tuple(rope[t] for t in types)}


def load_weights(model: DecoderModel, weights: dict[str, torch.Tensor]) -> None:
    """Gemma 2's tensors, then the Q/K norms again as 1 + weight (`load_attention` copied
    them as they are)."""
    gemma2.load_weights(model, weights)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}.self_attn."
        for attr in ("q_norm", "k_norm"):
            copy_weight(getattr(layer, attr), gemma2.norm_weight(weights, f"{p}{attr}.weight"),
                        f"{p}{attr}")
