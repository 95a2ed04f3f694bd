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


class RequestTable:
    """The engine's requests: by id, by the scheduler's sequence id, and the choices of each
    n > 1 request (its family, by the request's wire id)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._families: dict[str, set[str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __getitem__(self, request_id: str) -> Request:
        return self._by_id[request_id]

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def by_seq(self, seq_id: int) -> Request:
        return self._by_seq[seq_id]

    def values(self):
        return self._by_id.values()

    def add(self, req: Request) -> None:
        if req.params.n > 1:
            self._families.setdefault(req.wire_id, set()).add(req.request_id)
        self._by_id[req.request_id] = req
        self._by_seq[req.seq_id] = req

    def pop(self, request_id: str) -> Request | None:
        req = self._by_id.pop(request_id, None)
        if req is not None:
            self._by_seq.pop(req.seq_id, None)
            family = self._families.get(req.wire_id)
            if family is not None:
                family.discard(request_id)
                if not family:
                    del self._families[req.wire_id]
        return req

    def family(self, request_id: str) -> list[Request]:
        """Every choice still held of request `request_id` (itself when n == 1)."""
        ids = sorted(self._families.get(request_id, ())) or [request_id]
        return [self._by_id[i] for i in ids if i in self._by_id]
