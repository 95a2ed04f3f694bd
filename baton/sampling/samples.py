"""What a step asks of sampling beyond the token (prompt logprob spans) and what it returns
(`StepSamples`): the contract between the engine core and any model runner, real or mock."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baton.sampling.logprobs import PromptLogprobs, TopLogprobs


@dataclass
class PromptSpan:
    """Prompt logprobs wanted from one row's prompt chunk: chunk positions first.. predict
    `targets` (the prompt tokens after them), with `num_top` alternatives each."""

    first: int
    targets: list[int]
    num_top: int = 0


@dataclass
class StepSamples:
    """What `execute` sampled, row by row."""

    # int32 [n]; on a decode step whose rows carry drafts, [n, 1 + k] as the scheduler books it
    # (S31): column 0 the token sampled after the kept drafts, columns 1.. the kept drafts, -1
    # from the first rejected one.
    token_ids: np.ndarray
    logprobs: np.ndarray  # fp32, the layout of token_ids
    # rows asking top_logprobs; with drafts, one entry per kept draft and then the sampled token
    top: list[TopLogprobs | None]
    prompt: list[PromptLogprobs | None]  # rows given a PromptSpan
    # Rows given more choices (n > 1, the prompt's end): their (token ids, logprobs), one
    # per extra choice, drawn from the row's logits.
    choices: list[tuple[list[int], list[float]] | None] = field(default_factory=list)
