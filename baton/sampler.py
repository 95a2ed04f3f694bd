"""Sampling parameters and a batched sampler (greedy, temperature, top-k, top-p, per-request seed).

A seeded request owns a `torch.Generator`: its draws depend only on its seed and how many tokens
it has sampled, never on what else shares the batch, so the same seed gives the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_EPS = 1e-5  # temperatures below this are greedy


@dataclass
class SamplingParams:
    """Per-request decoding settings."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # private generator: same seed, same tokens
    max_tokens: int = 16  # tokens to generate at most
    stop_token_ids: tuple[int, ...] = ()  # finish (reason "stop") on any of these
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    logprobs: bool = False  # return the log-probability of each chosen token

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or a positive int, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A fresh generator for a seeded, non-greedy request; None otherwise."""
        if self.seed is None or self.is_greedy:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p drop; rows with k=0 and p=1 are untouched."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p; the top token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Chooses one token per row of a logits batch."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits fp32 [n, vocab] -> (token ids int64 [n], their log-probs fp32 [n]).

        Log-probs are of the model's distribution (before temperature / top-k / top-p).
        `generators[i]` (from `SamplingParams.make_generator`) drives row i when given.
        """
        n = logits.shape[0]
        assert len(params) == n, (len(params), n)
        generators = generators if generators is not None else [None] * n
        logits = logits.float()
        logprobs_all = logits.log_softmax(dim=-1)
        chosen = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            chosen[rows] = self._sample_rows(logits[rows], [params[i] for i in rows],
                                             [generators[i] for i in rows])
        return chosen, logprobs_all.gather(-1, chosen[:, None])[:, 0]

    @staticmethod
    def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        out = torch.empty(len(params), dtype=torch.long, device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            out[shared] = torch.multinomial(probs[shared], 1)[:, 0]
        for i, gen in enumerate(generators):
            if gen is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return out
