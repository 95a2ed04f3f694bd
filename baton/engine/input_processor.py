"""Input processing: a request's prompt, earlier outputs and grammar checked before the
scheduler sees it, and the scheduler's stop settings for it (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence

from baton.engine.grammar import GrammarCache
from baton.sampling.params import SamplingParams


class InputProcessor:
    """Checks of one engine's model: vocabulary, EOS ids, the tokenizer, compiled grammars."""

    def __init__(self, tokenizer, model_config) -> None:
        self.tokenizer, self.model_config = tokenizer, model_config
        self._grammars: GrammarCache | None = None  # built at the first structured request

    def check_prompt(self, request_id: str, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids; ValueError when it is empty or holds an id out of range."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if max(ids) >= self.model_config.vocab_size or min(ids) < 0:
            raise ValueError(f"request {request_id!r}: token id out of range "
                             f"[0, {self.model_config.vocab_size})")
        return ids

    def check_outputs(self, request_id: str, output_token_ids: Sequence[int],
                      params: SamplingParams) -> list[int]:
        """A migrated request's earlier outputs; ValueError when an id is out of range or
        nothing is left to generate (the router finishes such a request itself)."""
        outputs = [int(t) for t in output_token_ids]
        if outputs and (max(outputs) >= self.model_config.vocab_size or min(outputs) < 0):
            raise ValueError(f"request {request_id!r}: output token id out of range "
                             f"[0, {self.model_config.vocab_size})")
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"request {request_id!r}: {len(outputs)} earlier outputs leave "
                             f"nothing of max_tokens={params.max_tokens}")
        return outputs

    def stop_options(self, params: SamplingParams) -> dict:
        """The scheduler's stop settings (S31) for a request; a structured one is never
        recomputed (its matcher cannot be replayed): preempted, it finishes."""
        return {"eos_token_ids": self.model_config.eos_token_ids,
                "stop_token_ids": params.stop_token_ids, "ignore_eos": params.ignore_eos,
                "structured_output": bool(params.grammar)}

    @property
    def grammars(self) -> GrammarCache:
        """The grammar cache (built at the first structured request)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size,
                                          self.model_config.eos_token_ids)
        return self._grammars

    def check_grammar(self, params: SamplingParams, token_ids: Sequence[int] = ()) -> None:
        """ValueError unless the request's grammar compiles and accepts `token_ids` (sampled
        elsewhere: a prompt engine's first token)."""
        if params.grammar:
            matcher = self.grammars.matcher(params.grammar)
            if token_ids and not matcher.consume_tokens([int(t) for t in token_ids]):
                raise ValueError(f"tokens {list(token_ids)} break the request's grammar: "
                                 f"{matcher.get_error()}")
