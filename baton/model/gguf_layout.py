"""llama.cpp's GGUF layout of each family Baton loads from a GGUF file: its architecture name ->
the family (`families.FAMILIES`), its tensor names -> the Hugging Face names the family's loader
takes, and the header keys that say what config.json would.

The names are llama.cpp's (`gguf.constants.TENSOR_NAMES`, written by its
`convert_hf_to_gguf.py`). Only Llama's Q and K rows are permuted by that converter (its RoPE
pairs adjacent rows); Qwen2/3, Phi-3 and Qwen3-MoE use llama.cpp's NeoX RoPE on HF's row order.
Gemma 2's converter stores its norms as 1 + weight: they are turned back into HF's weight here,
and the family's loader adds the 1 again, as for a folder.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

ARCHS = {  # GGUF general.architecture -> the FAMILIES key (HF architecture)
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Families Baton loads from a Hugging Face folder whose GGUF files it refuses, and why: the
# header lacks what transformers reads from config.json (llama.cpp hard-codes it per model size).
REFUSED = {
    "gemma2": "the header has no query_pre_attn_scalar (llama.cpp assumes head_dim, 27B aside)",
    "gemma3": "the header has no query_pre_attn_scalar, local RoPE base nor sliding-window "
              "pattern (llama.cpp hard-codes them per model size)",
}
PERMUTED_QK = {"llama"}  # the converter permutes Q/K rows for these (`unpermute_qk` undoes it)

_L = r"blk\.(\d+)\."
_P = r"model.layers.\1."
_NAMES = [  # every family's: GGUF tensor name pattern -> HF name
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (_L + r"attn_norm\.weight", _P + "input_layernorm.weight"),
    (_L + r"ffn_norm\.weight", _P + "post_attention_layernorm.weight"),
    (_L + r"attn_q\.(weight|bias)", _P + r"self_attn.q_proj.\2"),
    (_L + r"attn_k\.(weight|bias)", _P + r"self_attn.k_proj.\2"),
    (_L + r"attn_v\.(weight|bias)", _P + r"self_attn.v_proj.\2"),
    (_L + r"attn_q_norm\.weight", _P + "self_attn.q_norm.weight"),
    (_L + r"attn_k_norm\.weight", _P + "self_attn.k_norm.weight"),
    (_L + r"attn_qkv\.weight", _P + "self_attn.qkv_proj.weight"),
    (_L + r"attn_output\.weight", _P + "self_attn.o_proj.weight"),
    (_L + r"ffn_gate\.weight", _P + "mlp.gate_proj.weight"),
    (_L + r"ffn_up\.weight", _P + "mlp.up_proj.weight"),
    (_L + r"ffn_down\.weight", _P + "mlp.down_proj.weight"),
    (_L + r"ffn_gate_inp\.weight", _P + "mlp.gate.weight"),
    # [experts, rows, cols]: split into the published per-expert tensors (`split_experts`)
    (_L + r"ffn_gate_exps\.weight", _P + "mlp.experts.gate_proj"),
    (_L + r"ffn_up_exps\.weight", _P + "mlp.experts.up_proj"),
    (_L + r"ffn_down_exps\.weight", _P + "mlp.experts.down_proj"),
]
_ARCH_NAMES = {  # what a family's GGUF names mean where they differ from the table above
    "phi3": [(_L + r"ffn_up\.weight", _P + "mlp.gate_up_proj.weight")],  # gate rows, then up
}


def hf_name(arch: str, name: str) -> str | None:
    """The HF name of GGUF tensor `name` in a file of `arch`; None for what the model does not
    read (e.g. rope_freqs: recomputed from the header)."""
    for pat, rep in _ARCH_NAMES.get(arch, []) + _NAMES:
        if re.fullmatch(pat, name):
            return re.sub(pat + "$", rep, name)
    return None


def split_experts(weights: dict, name: str, w: np.ndarray) -> bool:
    """A stacked expert tensor (`...mlp.experts.gate_proj`) -> one HF tensor per expert in
    `weights`; False for any other name."""
    head, sep, part = name.rpartition(".experts.")
    if not sep or part.endswith(".weight"):
        return False
    for e in range(w.shape[0]):
        weights[f"{head}.experts.{e}.{part}.weight"] = w[e]
    return True


Get = Callable[..., object]  # key (without the architecture prefix), default -> header value


def _qwen3_moe(g: Get, names: set[str], num_layers: int) -> dict:
    return {"qk_norm": True, "num_experts": int(g("expert_count")),
            "num_experts_per_tok": int(g("expert_used_count")),
            "moe_intermediate_size": int(g("expert_feed_forward_length")),
            # llama.cpp's qwen3moe graph always renormalises the top-k weights
            "norm_topk_prob": True,
            "sparse_layers": tuple(f"blk.{i}.ffn_gate_inp.weight" in names
                                   for i in range(num_layers))}


def _phi3(g: Get, names: set[str], num_layers: int) -> dict:
    if names & {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise ValueError("Phi-3 long-context rope scaling (rope_factors_long/short) is not "
                         "supported")
    window = int(g("attention.sliding_window", 0) or 0)
    # transformers applies the window on every layer (llama.cpp's phi3 graph ignores it today)
    return {"layer_windows": (window,) * num_layers if window else ()}


EXTRAS: dict[str, Callable[[Get, set[str], int], dict]] = {  # arch -> ModelConfig fields it adds
    "llama": lambda g, names, n: {},
    "qwen2": lambda g, names, n: {"attention_bias": True},
    "qwen3": lambda g, names, n: {"qk_norm": True},
    "phi3": _phi3,
    "qwen3moe": _qwen3_moe,
}
