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
