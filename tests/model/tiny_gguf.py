"""A tiny random Llama written as a real GGUF file (gguf-py's writer): 2 layers, Q4_1 layer
weights (so --quantization auto runs int4), F32 embedding and norms, a byte-level BPE
tokenizer of the 256 byte symbols plus a few merges and two control tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from baton.tokenizer import bytes_to_unicode

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")

    def f32(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def q4(name: str, rows: int, cols: int) -> None:
        x = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        w.add_tensor(name, quantize(x, gguf.GGMLQuantizationType.Q4_1),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    head_dim = HIDDEN // HEADS
    f32("token_embd.weight", vocab, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        q4(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        q4(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        q4(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        q4(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        q4(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        q4(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        q4(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_FAMILY_ARCHS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Phi3ForCausalLM": "phi3", "Qwen3MoeForCausalLM": "qwen3moe"}


def write_family_gguf(path: Path, model) -> Path:
    """A transformers model of a non-Llama family as the GGUF file llama.cpp's
    convert_hf_to_gguf.py writes for it: the header keys of its converter, tensors renamed by
    gguf-py's own map (llama.cpp's `TensorNameMap`), experts stacked per layer, no Q/K
    permutation (only Llama's converter permutes), F32 throughout so that loading is exact; a
    byte-level BPE vocabulary as long as the model's."""
    import gguf
    import torch

    c = model.config
    arch = _FAMILY_ARCHS[type(model).__name__]
    w = gguf.GGUFWriter(str(path), arch)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or
                               c.rope_parameters["rope_theta"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(c.sliding_window or 0)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + ["t1"] + [f"t{i}" for i in range(len(symbols) + 1, c.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    state = model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name in [n for n in state if ".experts.0." in n]:  # stack each layer's experts
        head, part = name.split(".experts.0.")
        experts = [state.pop(f"{head}.experts.{e}.{part}") for e in range(c.num_experts)]
        state[f"{head}.experts.{part}"] = torch.stack(experts)
    for name in [n for n in state if n.endswith(".experts.gate_up_proj")]:  # as transformers 5
        head = name.removesuffix(".gate_up_proj")  # holds them: split as the converter does
        gate, up = state.pop(name).chunk(2, dim=-2)
        state[f"{head}.gate_proj.weight"], state[f"{head}.up_proj.weight"] = gate, up
        state[f"{head}.down_proj.weight"] = state.pop(f"{head}.down_proj")
    for name, t in state.items():
        # llama.cpp's qwen3moe has no dense MLP layer: a mlp_only_layers one keeps Llama's names
        new = names.get_name(name, try_suffixes=(".weight", ".bias")) or \
            dense_names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, t.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
