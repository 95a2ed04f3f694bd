"""The data of logprobs beyond the sampled token's own: the most likely alternatives of each sampled token
(OpenAI's `top_logprobs`) and a prompt's token logprobs (`echo` with `logprobs`).

Both read the model's distribution (log_softmax of the raw logits, before bias, penalties and
temperature), as the sampled token's logprob does (baton/model/sampler.py), so a greedy token's
logprob is its own first alternative's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TopLogprobs:
    """Per token: the `k` most likely token ids and their logprobs, best first."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: TopLogprobs) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)


@dataclass
class PromptLogprobs:
    """Prompt positions 1.. : each token's logprob given the ones before, and alternatives."""

    logprobs: list[float] = field(default_factory=list)
    top: TopLogprobs = field(default_factory=TopLogprobs)

    @property
    def top_token_ids(self) -> list[list[int]]:
        return self.top.token_ids

    @property
    def top_logprobs(self) -> list[list[float]]:
        return self.top.logprobs
