"""Loader: clear errors naming the path, and a Hugging Face folder that matches transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from baton.model import ModelLoadError, load_model
from baton.model.loader import ModelNotFoundError


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="nope.gguf") as err:
        load_model(missing)
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)


def test_not_a_model(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model at all")
    with pytest.raises(ModelLoadError, match="junk.gguf.*not a GGUF"):
        load_model(junk)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="empty.*no config.json"):
        load_model(empty)


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(bad)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(tmp_path)


def _tiny_hf_folder(folder: Path):
    """A random 2-layer Llama (untied, GQA) saved by transformers, with the real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .reference import baton_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
                      eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    baton_model().tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": baton_model().tokenizer.chat_template}))
    return model


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """(folder, the transformers model saved there), shared by this module's tests."""
    folder = tmp_path_factory.mktemp("tiny_hf")
    return folder, _tiny_hf_folder(folder)


def test_hf_folder_matches_transformers(tiny_hf) -> None:
    folder, ref = tiny_hf
    lm = load_model(folder, device="cpu")
    assert not lm.config.tie_word_embeddings and lm.config.eos_token_ids == (2,)
    from baton.model.runner import ModelRunner

    runner = ModelRunner(lm, 16, num_blocks=8)
    ids = lm.tokenizer.encode("Hello there, how are you doing today?")
    n = len(ids)
    logits = runner.forward(ids, range(n), [16 + p for p in range(n)], [n], [n],
                            np.array([[1, 2]], np.int32))
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")


def test_hf_folder_quantizes_from_float_into_gguf_blocks(tiny_hf) -> None:
    """A safetensors checkpoint's weights go into the same block formats as a GGUF file's, by
    gguf-py's quantizers from the float values; its untied head into Q8_0."""
    from baton.model.quant import Blocks
    from baton.model.runner import ModelRunner

    folder = tiny_hf[0]
    exact = load_model(folder, device="cpu")
    ids = exact.tokenizer.encode("Hello there, how are you doing today?")
    n = len(ids)

    def logits(lm):
        return ModelRunner(lm, 16, num_blocks=8).forward(
            ids, range(n), [16 + p for p in range(n)], [n], [n], np.array([[1, 2]], np.int32))[0]

    want = logits(exact)
    float_down = exact.model.layers[1].down_proj.data
    for quantization, kind, min_cos in (("int4", "Q4_1", 0.99), ("int8", "Q8_0", 0.9999)):
        lm = load_model(folder, device="cpu", quantization=quantization)
        down = lm.model.layers[1].down_proj
        assert (down.kind, lm.model.lm_head.kind) == (kind, "Q8_0")
        assert np.array_equal(down.blocks.numpy(), Blocks.of_float(float_down, kind).data)
        assert torch.equal(down.dense, Blocks.of_float(float_down, kind).dequantize())
        got = logits(lm)  # n <= 16 rows: every projection through the block kernels
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) >= min_cos
