"""The engine's request and what a step reports of it (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.sampling.logprobs import PromptLogprobs, TopLogprobs
from baton.sampling.params import SamplingParams


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta); `finished` on its last one."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | prompt_length_exceeded | ...
    # PROMPT engine: the prompt is done and its KV blocks stay allocated for a completion
    # engine to pull (released later with `release_handed_off`).
    handed_off_block_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    # On the request's first output: prompt tokens this engine took from its prefix cache.
    num_cached_tokens: int = 0
    top: TopLogprobs | None = None  # top_logprobs: alternatives of each new token
    prompt: PromptLogprobs | None = None  # prompt_logprobs, on the request's first output
    index: int = 0  # the choice (n > 1) this output is of
    base_id: str = ""  # the request's id when this is another choice than its carrier's


@dataclass
class CompletionOutput:
    """A finished request (offline `generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


@dataclass
class Request:
    """One request (one choice of it, with n > 1) in the engine: its tokens, sampling and grammar
    state, logprobs, and where it came from. The one place an engine keeps a request's state;
    the scheduler keeps only its blocks and queue position (`seq_id`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    seq_id: int = -1  # the scheduler's stable integer id
    num_given: int = 0  # outputs it arrived with (a migration's, a prompt engine's first token)
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached
    prompt_logprobs: PromptLogprobs | None = None  # filled chunk by chunk while prefilling
    matcher: Any = None  # structured output: its llguidance matcher (baton/engine/grammar.py)
    index: int = 0  # the choice (n > 1) this sequence is (baton/engine/choices.py)
    base_id: str = ""  # the request's id, when this sequence is one of its forked choices
    base_sample_index: int = 0  # choice i draws with this + i
    is_split: bool = True  # False: n > 1 and its first tokens are not drawn yet
    lora_name: str = ""  # the LoRA adapter it runs with ("" = the base model)

    @property
    def wire_id(self) -> str:
        return self.base_id or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)
