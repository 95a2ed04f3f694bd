"""What a request asks of sampling: `SamplingParams`, checked on construction (torch-free: the
engine core, the router and the simulator build them without loading a model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from baton.protocol import MAX_CHOICES, MAX_TOP_LOGPROBS

_EPS = 1e-5  # temperatures below this are greedy


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Per-request decoding settings."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # same seed, same tokens (a hash of seed, index, position)
    max_tokens: int = 16  # tokens to generate at most
    stop_token_ids: tuple[int, ...] = ()  # finish (reason "stop") on any of these
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    logprobs: bool = False  # return the log-probability of each chosen token
    presence_penalty: float = 0.0  # OpenAI's: minus this once for any token already output
    frequency_penalty: float = 0.0  # OpenAI's: minus this per earlier output of the token
    repetition_penalty: float = 1.0  # vLLM's/CTRL's: a prompt or output token's logit / (or *) it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many outputs
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability
    # Which choice of a request this is (n > 1 forks one prompt into choices 0..n-1): mixed
    # into a seeded row's randomness so choices of one seed differ, each one reproducibly.
    sample_index: int = 0
    top_logprobs: int = 0  # with logprobs: this many most likely (id, logprob) per token
    prompt_logprobs: int = -1  # >= 0: the prompt tokens' logprobs, this many alternatives each
    grammar: str = ""  # an llguidance grammar the output follows (baton/engine/grammar.py); "" = none
    # Choices of one prompt (OpenAI's n): choice i draws with sample_index + i (baton/engine/choices.py)
    n: int = 1
    # False: never verify drafts for this request (an engine speculating decodes it plainly);
    # the output does not depend on it, only the speed (baton/engine/speculation.py).
    speculative: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or a positive int, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.sample_index, int) or self.sample_index < 0:
            raise ValueError(f"sample_index must be a non-negative int, got {self.sample_index!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        self._check_penalties()
        self._check_logprobs()
        if self.top_k == -1:
            self.top_k = 0

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not _is_real(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {r!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for token, bias in dict(self.logit_bias).items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not _is_real(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} "
                                 f"for token {token}")
        self.logit_bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}

    def _check_logprobs(self) -> None:
        k = self.top_logprobs
        if not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if k and not self.logprobs:
            raise ValueError(f"top_logprobs={k} needs logprobs=True")
        k = self.prompt_logprobs
        if not isinstance(k, int) or not -1 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be -1 (off) or in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {k!r}")

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS
