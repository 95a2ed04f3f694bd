"""Weight-only quantization (`baton/model/quant.py`): GGUF blocks are taken as stored, the
kernels compute what the blocks say, and every fast mode keeps >= 98% teacher-forced top-1
agreement with the exact mode (fp32, no quantization) over 2000 tokens of held-out text."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from baton.engine import EngineConfig
from baton.model.quant import QUANT_MAX_ROWS

from .reference import baton_model, held_out_tokens, teacher_forced_top1

NUM_TOKENS = 2048
CHUNK = QUANT_MAX_ROWS  # teacher-forced chunks this small run through the int kernels


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
    """Few rows go through the kernels (Q4_1 layers, Q8_0 head), many through the dense copy,
    which holds the blocks' values."""
    from baton.model.backends.cpu import linear, lm_head
    from baton.model.quant import QuantizedWeight

    model = _loaded("int4").model
    qkv, head = model.layers[0].qkv_proj, model.lm_head
    assert isinstance(head, QuantizedWeight) and (qkv.kind, head.kind) == ("Q4_1", "Q8_0")
    assert head.dense.data_ptr() == model.embed_tokens.data_ptr()  # no second copy
    x = torch.randn(QUANT_MAX_ROWS + 1, model.config.hidden_size,
                    generator=torch.Generator().manual_seed(0))
    for w, f in ((qkv, linear), (head, lm_head)):
        few, many = f(x[:QUANT_MAX_ROWS], w), f(x, w)
        assert torch.equal(few, w.matmul(x[:QUANT_MAX_ROWS]))
        assert torch.allclose(many, x @ w.dense.T, rtol=1e-4, atol=1e-4)
        assert torch.allclose(few, many[:QUANT_MAX_ROWS], rtol=0.05, atol=0.05 * many.abs().max())


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
    got = teacher_forced_top1(loaded, held_out_tokens(NUM_TOKENS), chunk=CHUNK)
    agreement = float((got == exact).float().mean())
    print(f"{quantization}: top-1 agreement {agreement:.4f} over {len(exact)} tokens")
    assert len(exact) >= 2000
    assert agreement >= 0.98, agreement
