"""The model families Baton runs from a Hugging Face folder (or a GGUF file, `gguf_layout.py`):
architecture name -> model class, the config.json keys beyond the common ones, and the
checkpoint's tensor names.

Each family's module holds its math over the shared layers (`layers.py`); the loader reads the
common config keys (`loader._hf_config`) and asks the family for the rest. Quantized modes
(int8/int4) run every family: `quant.quantize_model` takes each layer's fused projections and
a sparse layer's experts (the gate per family: tests/model/test_families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.model import gemma2, gemma3, llama, phi3, qwen
from baton.model.layers import DecoderModel


@dataclass(frozen=True)
class Family:
    name: str  # what a message calls it
    model_class: type[DecoderModel]
    # config.json -> the ModelConfig fields this family adds; ValueError names what it refuses
    read_config: Callable[[dict], dict]
    load_weights: Callable[[DecoderModel, dict[str, torch.Tensor]], None]
    # read_config reads the RoPE keys itself (per layer type: Gemma 3); else the loader does
    reads_rope: bool = False


def _llama_config(raw: dict) -> dict:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    if raw.get("sliding_window") or raw.get("layer_types"):
        raise ValueError("Llama has no sliding window; a config with one is another family")
    return {}


def _mistral_config(raw: dict) -> dict:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    window = raw.get("sliding_window")
    return {"layer_windows": (window,) * raw["num_hidden_layers"] if window else ()}


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("Llama", llama.LlamaModel, _llama_config, llama.load_weights),
    "MistralForCausalLM": Family("Mistral", llama.LlamaModel, _mistral_config,
                                 llama.load_weights),
    "Qwen2ForCausalLM": Family("Qwen2", qwen.QwenModel, qwen.qwen2_config, llama.load_weights),
    "Qwen3ForCausalLM": Family("Qwen3", qwen.QwenModel, qwen.qwen3_config, llama.load_weights),
    "Phi3ForCausalLM": Family("Phi-3", phi3.Phi3Model, phi3.phi3_config, phi3.load_weights),
    "Gemma2ForCausalLM": Family("Gemma 2", gemma2.Gemma2Model, gemma2.gemma2_config,
                                gemma2.load_weights),
    "Gemma3ForCausalLM": Family("Gemma 3", gemma3.Gemma3Model, gemma3.gemma3_config,
                                gemma3.load_weights, reads_rope=True),
    "Qwen3MoeForCausalLM": Family("Qwen3-MoE", qwen.Qwen3MoeModel, qwen.qwen3_moe_config,
                                  qwen.load_moe_weights),
}
