"""A batched sampler (greedy, temperature, top-k, top-p, min-p,
per-request seed, penalties, logit bias, min_tokens).

Every non-greedy row draws by inverse CDF: one uniform number u per row, the token whose
cumulative probability first exceeds u. A seeded row's u is a splitmix64 hash of (seed,
sample_index, output position) and nothing else, so its token depends only on those and its
logits: not on the batch, nor on which engine samples it, nor on how often the request was
preempted and recomputed or migrated (the position counts the outputs generated before, on
whatever engine). An unseeded row's u comes from torch's generator. One batched cumsum and
searchsorted replaces a multinomial per row, which costs far more on CPU (bench figures in
the commit that made this change).

The logits of a row go through, in vLLM's order: logit_bias, the min_tokens mask (EOS and stop
ids at -inf while fewer than min_tokens outputs exist), repetition_penalty (over prompt and
output tokens), frequency and presence penalties (over output tokens), then greedy argmax or
temperature, min_p, top-k/top-p and a draw. Every input of that chain is the request's own
token ids, passed per call, so a migrated or recomputed request is in the same state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from baton.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, sample_index: int, position: int) -> float:
    """The uniform in [0, 1) a seeded row draws with at output `position` (0 = the first token):
    splitmix64 chained over the three, its top 24 bits (exact in fp32, where the CDF lives)."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (sample_index & _MASK64))
    x = _splitmix64(x ^ (position & _MASK64))
    return (x >> 40) / float(1 << 24)


_NUM_CANDIDATES = 512  # the most likely tokens top-k/top-p look at before sorting a whole row


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p drop; rows with k=0 and p=1 are untouched.

    Sorting a whole vocabulary costs ~3 ms a row on CPU (batch 32: 90 ms a step, most of the
    sampler). The kept set almost always lies among the few hundred most likely tokens, so those
    come first from `topk`; a row falls back to the full sort only when tokens past them might
    be kept. Either way the mask is the same: a token is dropped when its rank is >= k or the
    probability mass before it (over the top k, or the whole row without top-k) reaches p."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    num_cand = min(vocab, _NUM_CANDIDATES)
    if num_cand == vocab:
        return _top_k_top_p_sorted(logits, k, top_p)
    cand, order = logits.topk(num_cand, dim=-1)  # sorted, most likely first
    drop = torch.arange(num_cand, device=logits.device)[None, :] >= k[:, None]
    masked = cand.masked_fill(drop, float("-inf"))
    whole_row = k >= vocab  # no top-k: probabilities are over the whole row
    norm = torch.where(whole_row, logits.logsumexp(dim=-1), masked.logsumexp(dim=-1))
    probs = (masked - norm[:, None]).exp()
    drop |= probs.cumsum(dim=-1) - probs >= top_p[:, None]
    drop[:, 0] = False
    # Exact where every token past the candidates is dropped anyway: by top-k, or by top-p
    # because the candidates' mass already reaches p.
    covered = (k <= num_cand) | (whole_row & (probs.sum(dim=-1) >= top_p))
    untouched = whole_row & (top_p >= 1)
    out = torch.full_like(logits, float("-inf")).scatter_(
        -1, order, cand.masked_fill(drop, float("-inf")))
    out[untouched] = logits[untouched]
    rest = (~covered & ~untouched).nonzero()[:, 0]
    if len(rest):
        out[rest] = _top_k_top_p_sorted(logits[rest], k[rest], top_p[rest])
    return out


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """`_apply_top_k_top_p` by sorting whole rows (`k` already resolved to 1..vocab)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
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

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        # min_tokens masks these (unless ignore_eos) along with each request's stop_token_ids.
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 output_token_ids: Sequence[Sequence[int]] | None = None,
                 allowed_tokens: Sequence[torch.Tensor | None] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits fp32 [n, vocab] -> (token ids int64 [n], their log-probs fp32 [n]).

        Log-probs are of the model's distribution (before bias, penalties, temperature, top-k,
        top-p, min-p). `prompt_token_ids[i]` / `output_token_ids[i]` are row i's prompt and its
        outputs so far; penalties, min_tokens and a seed (whose draw depends on the number of
        outputs) need them (a request using those without them is an error), plain sampling
        does not. `allowed_tokens[i]` (bool [vocab], a grammar's mask) leaves row i only those
        tokens to choose from.
        """
        n = logits.shape[0]
        assert len(params) == n, (len(params), n)
        logits = logits.float()
        logprobs_all = logits.log_softmax(dim=-1)
        logits = self._process(logits, params, prompt_token_ids, output_token_ids)
        if allowed_tokens is not None and any(m is not None for m in allowed_tokens):
            logits = logits.clone()  # the caller's tensor stays as the model gave it
            for i, allowed in enumerate(allowed_tokens):
                if allowed is not None:
                    logits[i].masked_fill_(~allowed.to(logits.device), float("-inf"))
        chosen = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            uniforms = _uniforms([params[i] for i in rows], rows, output_token_ids,
                                 logits.device)
            chosen[rows] = self._sample_rows(logits[rows], [params[i] for i in rows], uniforms)
        return chosen, logprobs_all.gather(-1, chosen[:, None])[:, 0]

    def _process(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 prompt_token_ids: Sequence[Sequence[int]] | None,
                 output_token_ids: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """Logit bias, the min_tokens mask and the penalties, row by row where asked for."""
        rows = [i for i, p in enumerate(params)
                if p.logit_bias or p.min_tokens or p.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            p = params[i]
            if (p.min_tokens or p.has_penalties) and output_token_ids is None:
                raise ValueError("penalties and min_tokens need the rows' output_token_ids")
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
                bias = torch.tensor([b for t, b in p.logit_bias.items() if t < vocab])
                logits[i].index_add_(0, ids.to(logits.device), bias.to(logits.device))
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
                stops = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
                stops = [t for t in stops if t < vocab]
                logits[i, stops] = float("-inf")
        penalised = [i for i in rows if params[i].has_penalties]
        if penalised:
            _apply_penalties(logits, params, prompt_token_ids, output_token_ids, penalised)
        return logits

    @staticmethod
    def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                     uniforms: torch.Tensor) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temps[:, None]
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
            probs = logits.softmax(dim=-1)
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(~keep, float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        return _inverse_cdf(logits.softmax(dim=-1), uniforms)


def _uniforms(params: list[SamplingParams], rows: list[int],
              output_token_ids: Sequence[Sequence[int]] | None,
              device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per sampled row: hashed for a seeded row, drawn otherwise."""
    u = torch.rand(len(params), dtype=torch.float32)
    for j, (i, p) in enumerate(zip(rows, params, strict=True)):
        if p.seed is not None:
            if output_token_ids is None:
                raise ValueError("a seeded row needs its output_token_ids (its position)")
            u[j] = seeded_uniform(p.seed, p.sample_index, len(output_token_ids[i]))
    return u.to(device)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniforms[i] of the total.
    Only a token of nonzero probability is ever returned: past the last one the CDF is flat,
    and a target rounded up to the total is brought back to that last token."""
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    chosen = torch.searchsorted(cdf, target, right=True)[:, 0]
    vocab = probs.shape[-1]
    last_nonzero = vocab - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.minimum(chosen, last_nonzero)


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                     prompt_token_ids: Sequence[Sequence[int]] | None,
                     output_token_ids: Sequence[Sequence[int]], rows: list[int]) -> None:
    """vLLM's formula, in place, on rows `rows`: repetition (prompt and output tokens: positive
    logits divided by it, negative ones multiplied), then frequency (times the output count)
    and presence (once per token output). Only the rows' distinct tokens are touched, as flat
    indices into the batch, not a dense [rows, vocab] pass per term."""
    vocab = logits.shape[-1]
    flat_logits = logits.view(-1)
    device = logits.device

    def flat(ids_of: Sequence[Sequence[int]]) -> torch.Tensor:
        ids = [t + i * vocab for i in rows for t in ids_of[i] if t < vocab]
        return torch.tensor(ids, dtype=torch.long, device=device)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=device,
                            dtype=logits.dtype)

    out_idx, out_counts = torch.unique(flat(output_token_ids), return_counts=True)
    if any(params[i].repetition_penalty != 1 for i in rows):
        if prompt_token_ids is None:
            raise ValueError("repetition_penalty needs the rows' prompt_token_ids")
        seen = torch.unique(torch.cat([out_idx, flat(prompt_token_ids)]))
        r = per_row("repetition_penalty")[seen // vocab]
        x = flat_logits[seen]
        flat_logits[seen] = torch.where(x > 0, x / r, x * r)
    owner = out_idx // vocab
    flat_logits[out_idx] -= (per_row("frequency_penalty")[owner] * out_counts.to(logits.dtype)
                             + per_row("presence_penalty")[owner])


def sample_verified(sampler: Sampler, logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]],
                    drafts: Sequence[Sequence[int]],
                    allowed_tokens: Sequence[torch.Tensor | None] | None = None,
                    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Speculative decoding's verification of a decode step (baton/engine/speculation.py).

    Row i ran `1 + len(drafts[i])` query tokens: its last committed token, then its drafts;
    `logits` holds every such position of every row, flat, in row order. Position j of row i is
    sampled like a plain step whose outputs were `output_token_ids[i] + drafts[i][:j]` (the
    seed's position, penalties and min_tokens see the drafts before it; a grammar row's mask
    `allowed_tokens[i]` is bool [vocab], or [1 + k, vocab], the mask at each position), and the drafts are
    kept while each equals the token sampled at the position before it. For a model-free
    proposal (a point mass on draft d) this is standard rejection sampling: d is kept with
    probability p(d), and a rejected position's token is a draw from p given it is not d, i.e.
    p with d removed, renormalised. So greedy output, and a seeded request's, are the tokens
    plain decoding gives, and sampled output has the plain distribution.

    Returns the `[n, 1 + max drafts]` int32 matrix the scheduler books (S31: column 0 the token
    sampled after the kept drafts, columns 1.. the kept drafts, -1 from the first rejected
    one), the fp32 logprobs in the same layout, and the number kept per row.
    """
    vparams, vprompt, vout, vallowed = [], [], [], []
    for i, row_drafts in enumerate(drafts):
        outputs = list(output_token_ids[i])
        for j in range(len(row_drafts) + 1):
            vparams.append(params[i])
            vprompt.append(prompt_token_ids[i])
            vout.append(outputs + list(row_drafts[:j]) if j else outputs)
            # A grammar row that drafted has a mask per position ([1 + k, vocab]: the grammar
            # after the drafts before it), one that did not has its one mask.
            mask = None if allowed_tokens is None else allowed_tokens[i]
            vallowed.append(mask[j] if mask is not None and mask.dim() == 2 else mask)
    has_mask = allowed_tokens is not None and any(m is not None for m in allowed_tokens)
    ids, lps = sampler(logits, vparams, prompt_token_ids=vprompt, output_token_ids=vout,
                       allowed_tokens=vallowed if has_mask else None)
    ids, lps = ids.cpu().numpy(), lps.cpu().numpy()
    width = 1 + max((len(d) for d in drafts), default=0)
    tokens = np.full((len(drafts), width), -1, dtype=np.int32)
    logprobs = np.zeros((len(drafts), width), dtype=np.float32)
    kept_counts = []
    offset = 0
    for i, row_drafts in enumerate(drafts):
        kept = 0
        while kept < len(row_drafts) and int(ids[offset + kept]) == int(row_drafts[kept]):
            kept += 1
        tokens[i, 0], logprobs[i, 0] = ids[offset + kept], lps[offset + kept]
        tokens[i, 1:1 + kept] = ids[offset:offset + kept]
        logprobs[i, 1:1 + kept] = lps[offset:offset + kept]
        kept_counts.append(kept)
        offset += len(row_drafts) + 1
    return tokens, logprobs, kept_counts
