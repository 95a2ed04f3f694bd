"""Weight-only quantization (`baton/model/quant.py`): GGUF Q4 codes are taken as stored, the
kernels compute what the codes say, and every fast mode keeps >= 98% teacher-forced top-1
agreement with the exact mode (fp32, no quantization) over 2000 tokens of held-out text."""

from __future__ import annotations

import functools

import pytest
import torch

from baton.engine import EngineConfig
from baton.model.quant import QUANT_MAX_ROWS, int4_codes_of, pack_int4, quantize_int8

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


def test_kernels_compute_the_quantized_weights() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    q4 = pack_int4(int4_codes_of(w), torch.float32)
    q8 = quantize_int8(w, torch.float32)
    for q in (q4, q8):  # the kernel (bf16 activations) computes with the dense copy's weights
        want = x.bfloat16().float() @ q.dense.T
        assert torch.allclose(q.matmul(x), want, rtol=2e-2, atol=2e-2)
    assert (q8.dense - w).abs().max() <= w.abs().max() / 100
    assert (q4.dense - w).abs().max() <= (w.max() - w.min()) / 15


def test_gguf_q4_codes_are_the_stored_values() -> None:
    """int4 from the Q4_1 file: codes x scale + offset is exactly the dequantized tensor, Q and
    K rows unpermuted alike (no second rounding)."""
    from baton.model.loader import _gguf_config, _gguf_weights
    from baton.model_files import default_model_path, read_gguf

    path = default_model_path()
    reader = read_gguf(path)
    config = _gguf_config(path, reader, torch.float32)
    codes: dict = {}
    weights = _gguf_weights(path, reader, config, codes)
    assert len(codes) == 7 * config.num_layers
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        c = codes[name]
        n, k = c.codes.shape
        got = c.codes.float().view(n, k // 32, 32) * c.scale[..., None] + c.offset[..., None]
        assert torch.equal(got.view(n, k), weights[name]), name


@functools.cache
def _exact_top1() -> torch.Tensor:
    return teacher_forced_top1(baton_model(), held_out_tokens(NUM_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4"])  # int8 refuses this Q4_1 file (above)
def test_teacher_forced_agreement_with_exact_mode(quantization: str) -> None:
    from baton.model import load_model

    exact = _exact_top1()
    loaded = load_model(dtype="float32", device="cpu", quantization=quantization)
    got = teacher_forced_top1(loaded, held_out_tokens(NUM_TOKENS), chunk=CHUNK)
    agreement = float((got == exact).float().mean())
    print(f"{quantization}: top-1 agreement {agreement:.4f} over {len(exact)} tokens")
    assert len(exact) >= 2000
    assert agreement >= 0.98, agreement
