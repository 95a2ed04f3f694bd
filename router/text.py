"""The model's text side at the router: tokenizer, context length, and streamed output text.

The tokenizer and chat template come from baton/tokenizer.py, read from the GGUF metadata (or a
Hugging Face folder) through baton/model_files.py without loading any weights or torch.
`TextStream` turns token ids into text deltas: the incremental detokenizer never splits a
multi-byte character, and stop strings are found here, at the router, holding back any tail that
could still become one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from baton.load_cache import load_tokenizer, save_tokenizer
from baton.model_files import ModelLoadError, default_model_path, gguf_field, read_gguf
from baton.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str  # served name (/v1/models, the `model` field)
    tokenizer: Tokenizer
    max_model_len: int  # prompt + completion tokens the engines accept
    stop_token_ids: list[int] = field(default_factory=list)
    # The most characters one token stands for: a text over max_model_len times this cannot
    # fit, whatever the tokenizer makes of it (router/prepare.py refuses it untokenized).
    max_token_chars: int = 0
    max_n: int = 16  # the most choices (n) one request may ask for (RouterConfig.max_n)

    def __post_init__(self) -> None:
        if not self.max_token_chars:
            vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
            self.max_token_chars = max(map(len, vocab), default=1)


def load_model_info(path: str = "", name: str = "", max_model_len: int = 0,
                    load_cache_dir: str | None = None) -> ModelInfo:
    """Tokenizer and limits of the model at `path` (a GGUF file, a folder; empty = SmolLM2);
    a GGUF file's through the load cache in `load_cache_dir` (None: none), which saves parsing
    its vocabulary (baton/load_cache.py)."""
    resolved = Path(path or default_model_path())
    if not resolved.exists():
        raise ModelLoadError(resolved, "no such file or directory")
    if resolved.is_dir() and (resolved / "config.json").is_file():
        tokenizer = Tokenizer.from_folder(resolved)
        raw = json.loads((resolved / "config.json").read_text())
        context = int(raw.get("max_position_embeddings", 4096))
        checkpoint_eos = _checkpoint_eos_ids(resolved, raw)
    else:
        checkpoint_eos = []
        if resolved.is_dir():
            found = sorted(resolved.glob("*.gguf"))
            if len(found) != 1:
                raise ModelLoadError(resolved, f"folder holds {len(found)} .gguf files, not 1")
            resolved = found[0]
        cached = load_tokenizer(load_cache_dir, resolved) if load_cache_dir else None
        if cached is not None:
            tokenizer, context = cached
        else:
            tokenizer, context = _from_gguf(resolved)
            if load_cache_dir:
                save_tokenizer(load_cache_dir, resolved, tokenizer, context)
    if max_model_len > context:
        logger.warning("max_model_len %d exceeds the model's context %d", max_model_len, context)
    stop_ids = list(dict.fromkeys(
        ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        + [t for t in checkpoint_eos if 0 <= t < tokenizer.vocab_size]))
    info = ModelInfo(name=name or _default_name(resolved), tokenizer=tokenizer,
                     max_model_len=max_model_len or context, stop_token_ids=stop_ids)
    logger.info("model %s from %s: context %d, stop ids %s", info.name, resolved,
                info.max_model_len, stop_ids)
    return info


def _checkpoint_eos_ids(folder: Path, config: dict) -> list[int]:
    """The end-of-sequence ids a Hugging Face folder declares beside its tokenizer's:
    `eos_token_id` of generation_config.json and config.json, an id or a list. Chat
    checkpoints end a turn on an id the tokenizer does not call EOS (Llama 3's <|eot_id|>,
    Gemma 3's <end_of_turn>, Qwen's <|im_end|>); transformers' `generate` and vLLM stop on
    these, and so does the router."""
    found: list[int] = []
    sources = [config]
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        try:
            sources.insert(0, json.loads(gen_file.read_text()))
        except (OSError, ValueError) as exc:
            logger.warning("%s unreadable (%s): its EOS ids are not used", gen_file, exc)
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool):
                found.append(token)
    return found


def _from_gguf(path: Path) -> tuple[Tokenizer, int]:
    reader = read_gguf(path)
    arch = gguf_field(reader, "general.architecture", "llama")
    context = int(gguf_field(reader, f"{arch}.context_length", 4096))
    return Tokenizer.from_gguf(reader), context


def _default_name(path: Path) -> str:
    name = path.stem if path.suffix == ".gguf" else path.name
    return name.split(".")[0] if path.suffix == ".gguf" else name


class TextStream:
    """Token ids in, text deltas out; stops at the first stop string, which is cut off.

    With `min_tokens`, stop strings are looked for only in the text of the tokens after the
    first min_tokens (the engines mask EOS and stop ids until then; vLLM does the same).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = (), min_tokens: int = 0):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded text that may be the start of a stop string
        self._min_tokens = min_tokens
        self.num_tokens = 0  # token ids added so far
        self.text = ""  # everything returned so far
        self.is_stopped = False  # a stop string was found; nothing more comes out

    def add(self, token_ids: Iterable[int]) -> str:
        if self.is_stopped:
            return ""
        ids = list(token_ids)
        num_unmatched = max(0, self._min_tokens - self.num_tokens)
        self.num_tokens += len(ids)
        out = ""
        if num_unmatched:
            unmatched, ids = ids[:num_unmatched], ids[num_unmatched:]
            out = self._detok.add(unmatched)
            self.text += out
            if not ids:
                return out
        return out + self._emit(self._held + self._detok.add(ids), final=False)

    def flush(self) -> str:
        """At the end of the request: whatever was held back."""
        if self.is_stopped:
            return ""
        return self._emit(self._held + self._detok.flush(), final=True)

    def _emit(self, pending: str, final: bool) -> str:
        cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.is_stopped = True
            out, self._held = pending[:cut], ""
        elif final:
            out, self._held = pending, ""
        else:
            keep = self._longest_stop_prefix_suffix(pending)
            out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
