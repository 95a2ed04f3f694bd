"""Tokenizer (GPT-2 byte-level BPE from GGUF metadata, or any tokenizer.json), chat template, and
an incremental detokenizer for streaming.

Built the way transformers builds it from the same file, so token ids agree with the reference.
No torch here: the router uses this module without the model runtime (baton/model re-exports it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from baton.model_files import gguf_field

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=False))


def _render_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                   ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """encode/decode, special ids, chat template."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None,
                 add_bos_token: bool = False) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._template = None

    # ---------------------------------------------------------- construction
    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """From a `gguf.GGUFReader`'s metadata (byte-level BPE only); ValueError otherwise."""
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2)")
        tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
        types = list(gguf_field(reader, "tokenizer.ggml.token_type", []))
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens outside the byte alphabet are re-spelled byte by byte, as transformers does.
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        special = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL and set(t) <= alphabet]
        backend.add_special_tokens(special)
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED])
        return cls(backend, bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
                   eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
                   chat_template=gguf_field(reader, "tokenizer.chat_template"),
                   add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """From tokenizer.json (+ tokenizer_config.json / chat_template.jinja) in `folder`."""
        folder = Path(folder)
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()

        def token_id(name: str) -> int | None:
            tok = cfg.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if tok else None

        # A post-processor in tokenizer.json already adds BOS when the model wants it.
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=template, add_bos_token=False)

    # ---------------------------------------------------------- use
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """Render `messages` ([{"role", "content"}]) with the model's template (ValueError if none)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = _render_env().from_string(self.chat_template)
        special = lambda i: self.backend.id_to_token(i) if i is not None else ""  # noqa: E731
        text = self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=special(self.bos_token_id),
                                     eos_token=special(self.eos_token_id), **kwargs)
        # The template writes BOS itself when the model wants one: no second BOS on encode.
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a multi-byte UTF-8 character.

    Decodes a short window [prefix_offset:] and emits only what goes beyond the text of
    [prefix_offset:read_offset]; a window whose text ends in U+FFFD (an incomplete byte
    sequence) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append token(s); return the new complete text (possibly "")."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.token_ids.extend(ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is held back (replacement chars included)."""
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
