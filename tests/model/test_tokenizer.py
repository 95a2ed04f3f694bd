"""Tokenizer from GGUF metadata vs transformers' tokenizer of the same file; chat template;
incremental detokenizer on multi-byte text."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from baton.model import IncrementalDetokenizer, default_model_path

from .reference import baton_model

TEXTS = [
    "Hello world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café, 東京, emoji 🎉🚀",
    "def f(x):\n    return x ** 2  # 12345", "<|im_start|>user\nhi<|im_end|>", "",
]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Why is the sky blue? 🌤"},
            {"role": "assistant", "content": "Rayleigh scattering."},
            {"role": "user", "content": "And sunsets?"}]


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(text: str) -> None:
    tok = baton_model().tokenizer
    ids = tok.encode(text)
    assert ids == hf_tokenizer().encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_ids_and_chat_template_match_transformers() -> None:
    tok, ref = baton_model().tokenizer, hf_tokenizer()
    assert tok.eos_token_id == ref.eos_token_id == 2
    for messages in (MESSAGES, MESSAGES[1:2]):
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(messages) == want
        assert tok.apply_chat_template(messages, tokenize=True) == ref.encode(want)
    assert "You are a helpful AI assistant" in tok.apply_chat_template(MESSAGES[1:2])


def test_incremental_detokenizer_never_splits_characters() -> None:
    tok = baton_model().tokenizer
    text = "Grüße aus 東京 🎉🚀 — ça va? 👩‍👩‍👧"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens were partial characters


def test_detokenizer_skips_special_tokens() -> None:
    tok = baton_model().tokenizer
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add(i) for i in tok.encode("Hi<|im_end|>")) + detok.flush()
    assert out == "Hi"
