"""Logprobs read from the logits (torch): a token's own, its top alternatives, a prompt's.

The data they fill (`TopLogprobs`, `PromptLogprobs`) is torch-free, in baton/sampling/logprobs.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baton.sampling.logprobs import PromptLogprobs, TopLogprobs

# Rows of [rows, vocab] log_softmax at a time: a 2048-token prompt chunk is 400 MB of fp32
# logits for SmolLM2's 49152-token vocabulary; its log_softmax need not be as much again.
_ROWS_PER_SLICE = 256


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
