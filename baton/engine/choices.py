"""Choices of one prompt (OpenAI's `n`): prefilled once, then one sequence per choice.

A request with n > 1, in any role:
1. Its prompt is one scheduler sequence (the *carrier*), prefilled once. The step that ends the
   prompt draws n first tokens from the last position's logits: choice i with sample_index
   base + i, so a seeded choice i is the same token whatever else runs (baton/model/sampler.py).
2. `plan_split` picks which choice the carrier goes on as: the first whose token does not end
   it (EOS, a stop id), since a sequence the scheduler finished cannot be forked. Choices that
   end at their first token need no sequence at all.
3. NORMAL: every other choice that goes on is forked from the carrier (`fork_seq` with its own
   first token: the prompt's blocks are shared, pinned; the half-written tail block cloned on
   admission, S16). PROMPT: nothing is forked; the hand-off carries every first token and the
   completion engine forks after the one pull. COMPLETION: the pulled sequence is the first
   choice the router names, the others are forked from it once its KV has landed.
4. Each choice decodes on its own and finishes on its own; an abort of the request ends them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from baton.sampling.params import SamplingParams


def choice_id(request_id: str, index: int) -> str:
    """The scheduler's id of a request's choice `index` other than its carrier."""
    return f"{request_id}#{index}"


def for_choice(params: SamplingParams, base_sample_index: int, index: int) -> SamplingParams:
    """Choice `index`'s own params: its draws are mixed with sample_index base + index."""
    return dataclasses.replace(params, sample_index=base_sample_index + index)


def stops_at(params: SamplingParams, eos_token_ids: Sequence[int], token: int) -> bool:
    """Whether `token` finishes a sequence with reason stop (the scheduler's S31 stop set)."""
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


@dataclass
class ChoiceSplit:
    """The first tokens of an n > 1 prompt and what becomes of each choice."""

    token_ids: list[int]  # choice i's first token
    logprobs: list[float]
    carrier: int  # the choice the prompt's own sequence goes on as
    reasons: list[str]  # "" = goes on, else the finish reason of its first token

    def others(self) -> list[int]:
        return [i for i in range(len(self.token_ids)) if i != self.carrier]


def plan_split(params: SamplingParams, eos_token_ids: Sequence[int], token_ids: list[int],
               logprobs: list[float], is_length_capped: bool) -> ChoiceSplit:
    """Which choice carries the prompt's sequence, and which end at their first token
    (`is_length_capped`: the first token reaches max_tokens or the model length: all do)."""
    reasons = ["stop" if stops_at(params, eos_token_ids, t) else
               "length" if is_length_capped else "" for t in token_ids]
    carrier = next((i for i, r in enumerate(reasons) if not r), 0)
    return ChoiceSplit(token_ids, logprobs, carrier, reasons)


def choice_params(reqs: Sequence, complete: Sequence[bool]) -> list | None:
    """The other choices' params of each row that draws an n > 1 prompt's first tokens (a
    complete row of a request not split yet); None when no row does."""
    if all(r.is_split for r in reqs):
        return None
    return [[for_choice(r.params, r.base_sample_index, i) for i in range(1, r.params.n)]
            if c and not r.is_split else None for r, c in zip(reqs, complete, strict=True)]


def plan_splits(reqs: Sequence, samples, eos_token_ids: Sequence[int],
                max_model_len: int) -> list[tuple]:
    """Before booking: (request, ChoiceSplit, top logprobs) of each row that drew its
    choices. A row whose carrier is not choice 0 books the carrier's token instead, and the
    request's sequence goes on as that choice (its index and sample_index)."""
    splits = []
    for i, (req, extra) in enumerate(zip(reqs, samples.choices or [None] * len(reqs),
                                         strict=True)):
        if extra is None:
            continue
        tokens = [int(samples.token_ids[i]), *extra[0]]
        lps = [float(samples.logprobs[i]), *extra[1]]
        capped = (req.params.max_tokens - req.num_given <= 1
                  or req.num_tokens + 1 > max_model_len)
        split = plan_split(req.params, eos_token_ids, tokens, lps, capped)
        if split.carrier:
            samples.token_ids[i], samples.logprobs[i] = tokens[split.carrier], lps[split.carrier]
            req.index = split.carrier
            req.params = for_choice(req.params, req.base_sample_index, split.carrier)
        req.is_split = True
        splits.append((req, split, samples.top[i]))
    return splits
