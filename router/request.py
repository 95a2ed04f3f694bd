"""One request's state in the router: its choices, its attempts, and their legs on engines.

A request's life in the router:
  1. router/serving.py makes a `RouterRequest` from the prepared request (router/prepare.py):
     one `RouterChoice` per choice (n), each with its text stream and logprobs to fill;
  2. router/dispatch.py runs an `Attempt` under a wire id: a `Leg` on a prompt engine then one
     on a completion engine (disaggregated), or one leg on a normal engine; each delta's tokens
     go to its choice (`RouterChoice.token_ids`), and an engine's finish reason closes the
     choice on the engines (`is_engine_finished`; `open_choices` are the ones still running);
  3. serving turns each delta into text on the same choice; its `finish_reason` is what the
     client is told: the engine's, or "stop" when a stop string matched in the router first.
     Once every choice has one (`is_answered`), the engines are aborted for the rest;
  4. an engine that fails after tokens went out: the dispatcher starts a new attempt (a
     migration) from the tokens of the one choice, under `REQ~mN`; with n > 1 each open choice
     goes on as a request of its own (`for_choice`: n = 1, `REQ~cI`) from its own tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from baton.ops.registry import EngineRecord
from baton.protocol import SamplingOptions, TokenDelta

if TYPE_CHECKING:
    from router.engine_client import EngineClient
    from router.load import LegWork
    from router.logprobs import CompletionLogprobs
    from router.path import PathChoice
    from router.text import TextStream


@dataclass
class Leg:
    """The request on one engine, during one attempt."""

    record: EngineRecord
    client: EngineClient
    queue: asyncio.Queue[TokenDelta]
    is_finished: bool = False
    num_blocks: int = 0  # what this leg adds to the engine's active blocks (cache-aware cost)
    work: LegWork | None = None  # its prefill and context tokens there (router/load.py)


@dataclass
class Attempt:
    """One pass through the engines: the first, or a migration after a failure."""

    wire_id: str  # the request's id on the engines: `REQ`, then `REQ~mN` for migration N
    output_token_ids: list[int]  # the tokens it starts from (a migration's: those streamed)
    legs: list[Leg] = field(default_factory=list)
    path: PathChoice | None = None  # co-located or disaggregated, and why (router/path.py)

    @property
    def is_migration(self) -> bool:
        return bool(self.output_token_ids)


@dataclass
class RouterChoice:
    """One choice of the answer (n > 1: several, each its own text, stop strings, logprobs)."""

    index: int
    text: TextStream
    token_ids: list[int] = field(default_factory=list)  # every token the engines sent for it
    is_engine_finished: bool = False  # an engine sent its finish reason
    finish_reason: str | None = None  # what the client is told (a stop string: "stop")
    num_generated: int = 0  # tokens counted in the usage (none past a stop string)
    num_deltas: int = 0  # deltas read into the text
    # logprobs asked: the completions shape, or chat's content entries (`chat_sent` of them
    # already streamed)
    completion_logprobs: CompletionLogprobs | None = None
    chat_logprobs: list[dict] = field(default_factory=list)
    chat_sent: int = 0

    def take_logprobs(self) -> dict | None:
        """Streaming: the logprobs of the tokens since the last chunk, in the choice's shape."""
        if self.completion_logprobs is not None:
            return self.completion_logprobs.take()
        if self.chat_sent < len(self.chat_logprobs):
            start, self.chat_sent = self.chat_sent, len(self.chat_logprobs)
            return {"content": self.chat_logprobs[start:]}
        return None

    def logprobs_body(self, has_logprobs: bool) -> dict | None:
        if not has_logprobs:
            return None
        if self.completion_logprobs is not None:
            return self.completion_logprobs.body()
        return {"content": self.chat_logprobs}


@dataclass
class RouterRequest:
    """Everything the router keeps of one request, from its first delta to its last chunk."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival: float  # monotonic time the request came in
    choices: list[RouterChoice]
    attempts: list[Attempt] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the engines took from their prefix caches
    cache_salt: str = ""  # the tenant's prefix-cache salt (baton/engine/block_keys.py)
    api_key_name: str = ""  # whose usage it counts as (router/api_keys.py)
    lora_name: str = ""  # the LoRA adapter it runs with ("" = the base model)
    # n > 1 after a failure: each open choice goes on as a request of its own (for_choice)
    is_split_by_choice: bool = False
    first_token_at: float = 0.0  # monotonic time its first token came (0: none yet)

    def __post_init__(self) -> None:
        assert [c.index for c in self.choices] == list(range(self.sampling.n)), \
            f"choices {[c.index for c in self.choices]} for n={self.sampling.n}"

    @property
    def num_migrations(self) -> int:
        return max(0, len(self.attempts) - 1)

    def start_attempt(self) -> Attempt:
        """A new attempt: the first under the request's id, a migration from the tokens
        streamed so far (n == 1: migrations are for one choice only)."""
        if not self.attempts:
            attempt = Attempt(self.req_id, [])
        else:  # n > 1 starts again only with nothing sent (a mixed fleet's other path)
            assert self.sampling.n == 1 or not self.has_output, \
                "an n > 1 request migrates choice by choice"
            attempt = Attempt(f"{self.req_id}~m{len(self.attempts)}",
                              list(self.choices[0].token_ids))
        self.attempts.append(attempt)
        return attempt

    def for_choice(self, index: int) -> RouterRequest:
        """Choice `index` of an n > 1 request as a request of its own, to migrate it: n = 1,
        the choice's sample_index (a seeded choice draws what it would have), its tokens so far
        (its next attempt is a migration from them), the migrations so far (one limit)."""
        choice = self.choices[index]
        sampling = msgspec.structs.replace(self.sampling, n=1,
                                           sample_index=self.sampling.sample_index + index)
        sub = RouterRequest(f"{self.req_id}~c{index}", self.prompt_token_ids, sampling,
                            self.arrival, [RouterChoice(0, choice.text,
                                                        token_ids=list(choice.token_ids))],
                            attempts=list(self.attempts), cache_salt=self.cache_salt,
                            api_key_name=self.api_key_name, lora_name=self.lora_name)
        return sub

    @property
    def has_output(self) -> bool:
        """Whether any token went out (a failure now is a migration, not a retry)."""
        return any(c.token_ids for c in self.choices)

    def open_choices(self) -> list[int]:
        """The choices the engines are still generating."""
        return [c.index for c in self.choices if not c.is_engine_finished]

    def is_open(self, index: int) -> bool:
        """Whether `index` (from a socket: any int) is a choice the engines still generate."""
        return 0 <= index < len(self.choices) and not self.choices[index].is_engine_finished

    @property
    def is_answered(self) -> bool:
        """Every choice has the finish reason the client is told."""
        return all(c.finish_reason for c in self.choices)

    def num_generated(self) -> int:
        return sum(c.num_generated for c in self.choices)
