"""Streamed text: token by token equals the whole decode, no piece ends inside a multi-byte
character, and stop strings are cut at the router even across token boundaries."""

from __future__ import annotations

import pytest

from router.text import TextStream

TEXT = "Grüße aus Köln! 你好，世界。 Emoji: 😀🎉👍🏽 done — ok…"


def _pieces(tokenizer, ids, stop=(), step=1):
    stream = TextStream(tokenizer, stop)
    pieces = [stream.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(stream.flush())
    return stream, [p for p in pieces if p]


@pytest.mark.parametrize("step", [1, 3])
def test_stream_equals_full_decode_without_split_characters(model_info, step):
    tok = model_info.tokenizer
    ids = tok.encode(TEXT)
    # The emoji need several byte-level tokens each, so a naive decode would split them.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    stream, pieces = _pieces(tok, ids, step=step)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert stream.text == TEXT
    assert not any("\ufffd" in piece for piece in pieces)


def test_special_tokens_are_not_text(model_info):
    tok = model_info.tokenizer
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    _, pieces = _pieces(tok, ids)
    assert "".join(pieces) == "Hi there"


@pytest.mark.parametrize("stop, expected", [
    (["Köln"], "Grüße aus "),
    (["世界"], "Grüße aus Köln! 你好，"),
    (["🎉"], "Grüße aus Köln! 你好，世界。 Emoji: 😀"),
    (["nothing", "! "], "Grüße aus Köln"),
    (["G"], ""),
    (["absent"], TEXT),
])
def test_stop_strings_cut_the_text(model_info, stop, expected):
    tok = model_info.tokenizer
    stream, pieces = _pieces(tok, tok.encode(TEXT), stop=stop)
    assert "".join(pieces) == expected == stream.text
    assert stream.is_stopped == (expected != TEXT)


def test_stop_prefix_is_held_then_released(model_info):
    tok = model_info.tokenizer
    stream = TextStream(tok, ["aus Bonn"])
    out = ""
    for i in tok.encode("Grüße aus Köln"):
        out += stream.add([i])
        assert not out.endswith("aus")  # could still become the stop string: held back
    assert out + stream.flush() == "Grüße aus Köln" and not stream.is_stopped


@pytest.mark.parametrize("step", [1, 4])
def test_min_tokens_holds_back_stop_strings(model_info, step):
    tok = model_info.tokenizer
    text = "one, two, one, two, three"
    ids = tok.encode(text, add_special_tokens=False)
    first_two = len(tok.encode("one, two", add_special_tokens=False))
    # Without min_tokens the first "two" stops; with it, only a "two" after that many tokens.
    assert _stream_text(tok, ids, ["two"], 0, step) == "one, "
    assert _stream_text(tok, ids, ["two"], first_two, step) == "one, two, one, "
    assert _stream_text(tok, ids, ["two"], len(ids), step) == text


def _stream_text(tok, ids, stop, min_tokens, step):
    stream = TextStream(tok, stop, min_tokens)
    out = "".join(stream.add(ids[i:i + step]) for i in range(0, len(ids), step))
    out += stream.flush()
    assert out == stream.text
    return out
