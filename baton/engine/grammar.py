"""Grammar-constrained decoding through llguidance: compiled grammars and token masks.

llguidance (Microsoft's, the engine under vLLM's and SGLang's `guidance` backend) is a plain
wheel with no dependencies, builds its token trie straight from the `tokenizers` JSON that
baton/tokenizer.py already holds (GGUF or HF folder alike), and computes a mask in a
millisecond or so on the CPU; xgrammar needs triton and transformers at run time and
outlines-core builds an index per schema up front. A grammar travels the wire as llguidance's
own serialized form (`LLMatcher.grammar_from_*`), made and validated by the router.

One request's matcher: a fresh copy of the grammar's pristine matcher (`GrammarCache`: each
grammar compiled once); before each sampled token `allowed_tokens` gives the mask, after it
`consume_token` advances it. A completion engine feeds its matcher the prompt engine's first
token, so both engines walk the same grammar path.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

from baton.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # distinct grammars kept compiled per engine
_tokenizers: dict[int, llguidance.LLTokenizer] = {}


def ll_tokenizer(tokenizer: Tokenizer, eos_token_ids: Sequence[int] = ()) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (about a second to build: once per tokenizer)."""
    if getattr(tokenizer, "backend", None) is None:  # a mock engine's word tokenizer
        raise ValueError("structured output needs the model's tokenizer; this engine's "
                         f"({type(tokenizer).__name__}) cannot run a grammar")
    key = id(tokenizer)
    found = _tokenizers.get(key)
    if found is None:
        eos = list(eos_token_ids) or tokenizer.eos_token_id
        found = _tokenizers[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                                          n_vocab=tokenizer.vocab_size,
                                                          eos_token=eos)
    return found


def grammar_error(grammar: str, tokenizer: Tokenizer) -> str:
    """"" when llguidance accepts `grammar`, else its message (the client's 400)."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    except (ValueError, RuntimeError) as exc:
        return str(exc)


class GrammarCache:
    """Pristine matchers by grammar, least recently used dropped past `_CACHE_SIZE`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = ll_tokenizer(tokenizer, eos_token_ids)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`; ValueError with llguidance's message if invalid."""
        pristine = self._compiled.get(grammar)
        if pristine is None:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise ValueError(f"invalid grammar: {error}")
            pristine = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            self.num_compiled += 1
            self._compiled[grammar] = pristine
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return pristine.deep_copy()

    def allowed_tokens(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar allows next."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if allowed.shape[0] < self.vocab_size:  # the model's vocabulary may be padded
            allowed = np.pad(allowed, (0, self.vocab_size - allowed.shape[0]))
        return allowed
