"""Logprobs in OpenAI's two shapes, from the engines' token ids and numbers.

Chat: `choice.logprobs.content` is a list of {token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}. Completions: `choice.logprobs` is {tokens, token_logprobs, top_logprobs,
text_offset}, parallel lists; each top_logprobs entry is a {token: logprob} map of the
alternatives plus the sampled token (OpenAI: "up to logprobs+1 elements"), and with echo the
prompt's first token has null in both (nothing precedes it).

A token's text is its own decoding; one that is only part of a UTF-8 character reads as
`bytes:\\xNN...` (OpenAI's spelling) and `bytes` always holds its exact bytes, from the byte-level
BPE alphabet when the tokenizer has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from baton.tokenizer import Tokenizer, bytes_to_unicode


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each character stands for."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenText:
    """Token id -> (text, bytes), cached per tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.token_text(token_id) or ""
        table = _byte_decoder()
        if piece and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
        else:  # an added or special token, or a tokenizer without the byte alphabet
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


def chat_content(text_of: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                 top_ids: Sequence[Sequence[int]], top_lps: Sequence[Sequence[float]]) -> list:
    """`logprobs.content` entries of these tokens (top lists may be empty: no alternatives)."""
    out = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        text, raw = text_of(token)
        alternatives = []
        if i < len(top_ids):
            for alt, alt_lp in zip(top_ids[i], top_lps[i], strict=True):
                alt_text, alt_raw = text_of(alt)
                alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return out


class CompletionLogprobs:
    """The completions shape, filled as tokens come; `take()` the part not yet sent."""

    def __init__(self, text_of: TokenText, text_offset: int = 0):
        self.text_of = text_of
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._sent = 0

    def add_null(self, token_id: int) -> None:
        """A token without a logprob: an echoed prompt's first."""
        self._add_text(token_id)
        self.token_logprobs.append(None)
        self.top_logprobs.append(None)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float],
            top_ids: Sequence[Sequence[int]], top_lps: Sequence[Sequence[float]]) -> None:
        for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            text = self._add_text(token)
            self.token_logprobs.append(lp)
            top = {}
            if i < len(top_ids):
                top = {self.text_of(alt)[0]: alt_lp
                       for alt, alt_lp in zip(top_ids[i], top_lps[i], strict=True)}
            top.setdefault(text, lp)
            self.top_logprobs.append(top)

    def _add_text(self, token_id: int) -> str:
        text = self.text_of(token_id)[0]
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        return text

    def body(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}

    def take(self) -> dict | None:
        """What was added since the last take (streaming), or None if nothing."""
        start, self._sent = self._sent, len(self.tokens)
        return self.body(start) if start < self._sent else None
