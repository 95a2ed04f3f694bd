"""Logprobs beyond the sampled token's own: the most likely alternatives of each sampled token
(OpenAI's `top_logprobs`) and a prompt's token logprobs (`echo` with `logprobs`).

Both read the model's distribution (log_softmax of the raw logits, before bias, penalties and
temperature), as the sampled token's logprob does (baton/sampler.py), so a greedy token's
logprob is its own first alternative's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Rows of [rows, vocab] log_softmax at a time: a 2048-token prompt chunk is 400 MB of fp32
# logits for SmolLM2's 49152-token vocabulary; its log_softmax need not be as much again.
_ROWS_PER_SLICE = 256


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


def top_logprobs(logits: torch.Tensor, k: int) -> TopLogprobs:
    """The k best (ids, logprobs) of each row of fp32 logits [n, vocab]; k = 0: empty lists."""
    out = TopLogprobs()
    for start in range(0, logits.shape[0], _ROWS_PER_SLICE):
        lp = logits[start:start + _ROWS_PER_SLICE].float().log_softmax(dim=-1)
        _append_top(out, lp, k)
    return out


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> PromptLogprobs:
    """Row i's logprob of token targets[i] (the next prompt token), with k alternatives."""
    assert logits.shape[0] == len(targets), (logits.shape, len(targets))
    out = PromptLogprobs()
    target = torch.as_tensor(list(targets), dtype=torch.long, device=logits.device)
    for start in range(0, logits.shape[0], _ROWS_PER_SLICE):
        lp = logits[start:start + _ROWS_PER_SLICE].float().log_softmax(dim=-1)
        rows = target[start:start + _ROWS_PER_SLICE]
        out.logprobs.extend(lp.gather(-1, rows[:, None])[:, 0].tolist())
        _append_top(out.top, lp, k)
    return out


def _append_top(out: TopLogprobs, lp: torch.Tensor, k: int) -> None:
    if k <= 0:
        out.token_ids.extend([] for _ in range(lp.shape[0]))
        out.logprobs.extend([] for _ in range(lp.shape[0]))
        return
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    out.token_ids.extend(ids.tolist())
    out.logprobs.extend(values.tolist())
