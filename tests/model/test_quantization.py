"""Weight-only quantization (`baton/model/quant.py`): GGUF blocks are taken as stored, the
kernels compute what the blocks say, and every fast mode keeps >= 98% teacher-forced top-1
agreement with the exact mode (fp32, no quantization) over 2000 tokens of held-out text."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from baton.engine import EngineConfig
from baton.model.backends import CPUBackend

from .reference import baton_model, held_out_tokens, teacher_forced_top1

NUM_TOKENS = 2048
CHUNK = 16  # teacher-forced chunks of a decode batch's size


def test_config_refuses_unknown_modes() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4")


def test_int8_refuses_4bit_weights() -> None:
    from baton.model import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="use --quantization int4"):
        load_model(device="cpu", quantization="int8")


def test_gguf_blocks_are_the_stored_values() -> None:
    """The quantized modes' weights from the Q4_1 file: its blocks byte for byte (Q and K rows
    unpermuted alike), whose values are exactly the exact mode's weights; the tied vocabulary
    projection its Q8_0 token_embd as stored."""
    from baton.model.loader import _gguf_config, _gguf_weights
    from baton.model_files import default_model_path, read_gguf

    path = default_model_path()
    reader = read_gguf(path)
    config = _gguf_config(path, reader, torch.float32)
    stored: dict = {}
    weights = _gguf_weights(path, reader, config, stored)
    assert len(stored) == 7 * config.num_layers + 1
    assert stored["model.embed_tokens.weight"].kind == "Q8_0"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(stored[name].dequantize(), weights[name]), name
    raw = next(t for t in reader.tensors if t.name == "blk.29.ffn_down.weight").data
    assert np.array_equal(stored["model.layers.29.mlp.down_proj.weight"].data,
                          np.asarray(raw).reshape(config.hidden_size, -1))


def test_int4_model_runs_the_block_kernels_on_decode_rows() -> None:
    """Decode rows go through the kernels (Q4_1 layers, Q8_0 head), prefill rows through the
    dense copy, which holds the blocks' values: chosen by the kind of row, so a decode row's
    numbers do not depend on what else its step holds."""
    from baton.model.quant import QuantizedWeight

    model = _loaded("int4").model
    qkv, head = model.layers[0].qkv_proj, model.lm_head
    assert isinstance(head, QuantizedWeight) and (qkv.kind, head.kind) == ("Q4_1", "Q8_0")
    assert head.dense.data_ptr() == model.embed_tokens.data_ptr()  # no second copy
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    backend = CPUBackend()

    def step(seqlens_q: list[int]) -> None:  # what prepare learns of a step's rows
        q = np.asarray(seqlens_q)
        backend._decode_token = np.repeat(q == 1, q)
    for w, f in ((qkv, backend.linear), (head, backend.lm_head)):
        step([1] * 40)  # 40 decode rows, more than a batch of 16
        all_decode = f(x, w)
        assert torch.equal(all_decode, w.matmul(x))
        step([1] * 3 + [37])  # three decode rows beside a prefill chunk
        mixed = f(x, w)
        assert torch.equal(mixed[:3], all_decode[:3])  # the same numbers whatever the step
        assert torch.allclose(mixed[3:], x[3:] @ w.dense.T, rtol=1e-4, atol=1e-4)
        step([40])
        assert torch.allclose(f(x, w), x @ w.dense.T, rtol=1e-4, atol=1e-4)


@functools.cache
def _loaded(quantization: str):
    from baton.model import load_model

    return load_model(dtype="float32", device="cpu", quantization=quantization)


@functools.cache
def _exact_top1() -> torch.Tensor:
    return teacher_forced_top1(baton_model(), held_out_tokens(NUM_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4"])  # int8 refuses this Q4_1 file (above)
def test_teacher_forced_agreement_with_exact_mode(quantization: str) -> None:
    exact = _exact_top1()
    loaded = _loaded(quantization)
    # Every row through the block kernels, as decode rows go (prefill chunks take the dense copy,
    # which holds the exact mode's weights: it would measure nothing).
    got = teacher_forced_top1(loaded, held_out_tokens(NUM_TOKENS), chunk=CHUNK,
                              backend=CPUBackend(kernel_rows="all"))
    agreement = float((got == exact).float().mean())
    print(f"{quantization}: top-1 agreement {agreement:.4f} over {len(exact)} tokens")
    assert len(exact) >= 2000
    assert agreement >= 0.98, agreement


def test_auto_runs_the_files_own_4bit_blocks() -> None:
    """--quantization auto (the servers' default): int4 for the default model's Q4_1 layers,
    none for float layers or where the kernels cannot run."""
    from baton.model.loader import load_model
    from baton.model.quant import resolve_auto

    assert resolve_auto({"Q4_1"}, kernels_run=True) == "int4"
    assert resolve_auto({"Q4_0", "Q4_1"}, kernels_run=True) == "int4"
    assert resolve_auto({"Q4_1", "F32"}, kernels_run=True) == "none"
    assert resolve_auto({"F16"}, kernels_run=True) == "none"
    assert resolve_auto({"Q4_1"}, kernels_run=False) == "none"
    assert resolve_auto(set(), kernels_run=True) == "none"
    assert load_model(quantization="auto", device="cpu").quantization == "int4"
    # The quantized modes' fused ops are fp32 kernels: auto keeps bf16 in the plain mode.
    assert load_model(quantization="auto", dtype="bfloat16").quantization == "none"
    with pytest.raises(ValueError, match="auto"):
        load_model(quantization="int3")
