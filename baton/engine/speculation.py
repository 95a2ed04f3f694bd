"""Speculative decoding's engine side (torch-free): which requests draft, how many drafts, and
what was accepted.

A speculating request's life, step by step:
1. After a step booked its tokens, `Speculator.propose` asks the request's proposer
   (`baton/engine/proposers.py`) for up to its current draft length; the engine hands the drafts
   to the scheduler's draft ledger (`set_draft_tokens`, docs/scheduler.md S4, S5, S28).
2. The next decode step schedules the row with `1 + k` query tokens: the last committed token,
   then the drafts. The model runs every row of the batch in one forward and the runner samples
   each of the row's `1 + k` positions as if the drafts before it were already outputs (its
   seed's position, penalties and min_tokens see them), then keeps the drafts up to the first
   one that differs from the token sampled before it: the `[n, 1 + k]` matrix the scheduler books
   (S31), -1 for a rejected draft. Greedy output is the plain one; a sampled token comes from
   the same distribution (that comparison *is* rejection sampling for a point-mass proposal:
   draft d is kept with probability p(d), and on rejection the token drawn is p with d removed,
   renormalised), and a seeded request draws the very tokens it draws without drafts.
3. `record` counts the drafts and the accepted ones (per position, for /metrics) and adapts
   the request's draft length: all kept -> one more (up to `num_speculative_tokens`), some
   rejected -> the number kept plus one.
4. The batch decides (`propose_batch`): a verified step of B rows and D drafts must give more
   tokens per second than a plain step of B rows, by the engine's own running averages of both
   step kinds at those sizes (`StepCosts`) and each row's expected kept drafts from its own
   request's recent acceptance; where it would not, no row drafts that step.
A grammar-constrained request drafts only the prefix its matcher accepts (checked without
advancing it), and its verified positions each get the mask after the drafts before them.
The choices of an n > 1 request draft once they are split (each its own sequence); the row
that draws their first tokens does not. A request that opts out
(`SamplingParams.speculative=False`) never drafts: it decodes as without speculation.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from baton.engine.proposers import SPECULATIVE_METHODS, NgramProposer, SuffixProposer, make_proposer
from baton.engine.request import Request

logger = logging.getLogger(__name__)

# A verified row's weight in its request's acceptance, one row later: about the last ten rows
# count. An engine-wide rate would let the copy-heavy requests of an hour ago vouch for a
# sampled stream that keeps none of its drafts.
_ACCEPTANCE_DECAY = 0.9


@dataclass
class _Drafting:
    """One request's proposer and its history as the proposer sees it (prompt + outputs)."""

    proposer: NgramProposer | SuffixProposer
    history: list[int]
    num_prompt: int
    k: int  # draft length for its next step (adaptive)
    # Its own recent drafts and accepted ones, each verified row's weight decaying by
    # _ACCEPTANCE_DECAY: what `expected_kept` judges its next row by.
    drafted: float = 0.0
    accepted: float = 0.0

    def acceptance(self) -> float:
        """A draft's chance to be kept after the one before it was: its recent rate, with a
        prior of one kept in two."""
        return (self.accepted + 1.0) / (self.drafted + 2.0)


@dataclass
class SpecStats:
    """Counters since start-up, exported on /metrics."""

    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, the accepted
    num_verify_rows: int = 0  # rows that carried at least one draft
    drafted_per_pos: list[int] = field(default_factory=list)  # rows with a draft at position j
    accepted_per_pos: list[int] = field(default_factory=list)  # rows whose draft j was accepted
    num_skipped_batches: int = 0  # steps whose drafts were dropped: verifying would not pay


class Speculator:
    """Drafts for the requests of one engine."""

    def __init__(self, method: str, num_speculative_tokens: int,
                 costs: StepCosts | None = None, disable_by_batch_size: int = 0) -> None:
        """`disable_by_batch_size` N > 0: a batch of N rows or more drafts nothing, a smaller
        one always drafts (no cost model); 0: `costs` decides."""
        if method not in SPECULATIVE_METHODS or method == "off":
            raise ValueError(f"speculative={method!r}: a Speculator needs one of "
                             f"{[m for m in SPECULATIVE_METHODS if m != 'off']}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        self.method = method
        self.max_k = num_speculative_tokens
        self._drafting: dict[str, _Drafting] = {}
        self.costs = costs or StepCosts()
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecStats(drafted_per_pos=[0] * num_speculative_tokens,
                               accepted_per_pos=[0] * num_speculative_tokens)

    @staticmethod
    def can_draft(req: Request) -> bool:
        """Whether a request's features allow verified drafts (else it decodes plainly)."""
        p = req.params
        return p.speculative and req.is_split

    def propose(self, req: Request) -> list[int]:
        """Drafts for the request's next decode step ([] = a plain step)."""
        state = self._drafting.get(req.request_id)
        if state is None:
            if not self.can_draft(req):
                return []
            state = _Drafting(make_proposer(self.method), list(req.prompt_token_ids),
                              len(req.prompt_token_ids), self.max_k)
            self._drafting[req.request_id] = state
        have = len(state.history) - state.num_prompt
        state.history.extend(req.token_ids[have:])
        # The step's sampled token comes on top of the drafts: never draft past max_tokens.
        k = min(state.k, req.params.max_tokens - len(req.token_ids) - 1)
        drafts = state.proposer.propose(state.history, k)
        if drafts and req.matcher is not None:  # only what the grammar accepts, state kept
            drafts = drafts[:req.matcher.validate_tokens(drafts)]
        return drafts

    def propose_batch(self, reqs: Sequence[Request], num_rows: int) -> dict[str, list[int]]:
        """Drafts of `reqs` for the next decode step of `num_rows` rows, or none at all when
        verifying them would yield fewer tokens per second than a plain step (`StepCosts`)."""
        drafts = {}
        for req in reqs:
            row = self.propose(req)
            if row:
                drafts[req.request_id] = row
        if not drafts:
            return drafts
        num_rows = max(num_rows, len(drafts))
        if self.disable_by_batch_size:
            pays = num_rows < self.disable_by_batch_size
        else:
            pays = self.costs.pays(num_rows, sum(len(row) for row in drafts.values()),
                                   sum(self.expected_kept(len(row), request_id)
                                       for request_id, row in drafts.items()))
        if pays:
            return drafts
        self.stats.num_skipped_batches += 1
        return {}

    def expected_kept(self, num_drafts: int, request_id: str) -> float:
        """Drafts the request's next row of `num_drafts` keeps on average, by its own recent
        acceptance a: a + a^2 + ... (a draft is kept only after the one before it)."""
        state = self._drafting.get(request_id)
        a = state.acceptance() if state is not None else 0.5
        return sum(a ** (j + 1) for j in range(min(num_drafts, self.max_k)))

    def record_step(self, request_ids: Sequence[str], seqlens_q: np.ndarray,
                    token_ids: np.ndarray) -> None:
        """A verified decode step (`token_ids` [n, 1 + k]): each row that carried drafts
        records how many the model kept, whether or not a stop cut the booking short."""
        for request_id, q, row in zip(request_ids, seqlens_q, token_ids, strict=True):
            if q > 1:
                self.record(request_id, int(q) - 1, _num_kept(row[1:int(q)]))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified row: `num_accepted` of its `num_drafts` drafts were kept."""
        stats = self.stats
        stats.num_drafted += num_drafts
        stats.num_accepted += num_accepted
        stats.num_verify_rows += 1
        for j in range(num_drafts):
            stats.drafted_per_pos[j] += 1
        for j in range(num_accepted):
            stats.accepted_per_pos[j] += 1
        state = self._drafting.get(request_id)
        if state is not None:
            state.k = min(self.max_k, state.k + 1 if num_accepted == num_drafts
                          else num_accepted + 1)
            # A row stops at its first rejection: it tried num_accepted + 1 drafts (all of
            # them when every one was kept).
            tried = min(num_drafts, num_accepted + 1)
            state.drafted = state.drafted * _ACCEPTANCE_DECAY + tried
            state.accepted = state.accepted * _ACCEPTANCE_DECAY + num_accepted

    def forget(self, request_id: str) -> None:
        self._drafting.pop(request_id, None)

    def metrics(self) -> dict[str, float]:
        """The counters as `EngineStats.extra` entries (baton/service/metrics.py)."""
        stats = self.stats
        out = {"spec_drafted_tokens": float(stats.num_drafted),
               "spec_accepted_tokens": float(stats.num_accepted),
               "spec_verify_rows": float(stats.num_verify_rows),
               "spec_skipped_batches": float(stats.num_skipped_batches)}
        for j in range(self.max_k):
            out[f"spec_drafted_pos_{j}"] = float(stats.drafted_per_pos[j])
            out[f"spec_accepted_pos_{j}"] = float(stats.accepted_per_pos[j])
        return out


def _num_kept(drafts: np.ndarray) -> int:
    """Kept drafts of a booked row's columns 1..: up to the first -1."""
    rejected = drafts < 0
    return int(np.argmax(rejected)) if rejected.any() else len(drafts)


def booked_tokens(samples, i: int, accepted: int) -> tuple[list[int], list[float]]:
    """Row i's booked tokens and their logprobs, in order: its one sampled token, or (a row of
    a verified step, `[n, 1 + k]`) the kept drafts, then the sampled token; cut at `accepted`,
    where booking stopped (a stop among the drafts)."""
    ids, lps = samples.token_ids[i], samples.logprobs[i]
    if samples.token_ids.ndim == 1:
        return [int(ids)], [float(lps)]
    kept = _num_kept(ids[1:])
    tokens = [*ids[1:1 + kept].tolist(), int(ids[0])]
    logprobs = [*lps[1:1 + kept].tolist(), float(lps[0])]
    return tokens[:accepted], logprobs[:accepted]


def _bucket(num: int) -> int:
    """Sizes up to 8 apart, then in steps of 8 (a step's cost grows smoothly with its size)."""
    return num if num <= 8 else -(-num // 8) * 8


class StepCosts:
    """Recent decode step times (seconds): plain steps by their rows, verified steps by their
    query tokens (rows + drafts), each in size buckets; a bucket's cost is the median of its
    last `window` steps (a shared host's stalls move a mean, not a median).

    Verifying B rows with D drafts pays when `verify(B + D) / (B + kept) < plain(B) / B`, the
    expected tokens per second of each. A plain step right after a verified or a prompt step is
    not counted (the CPU backend rebuilds a decode row a verified step left behind: a cost of
    switching, not of the steady state). Unmeasured sizes are measured first: no plain step at
    B yet, no drafts (the plain step measures it); fewer than `min_samples` verified ones at
    B + D, drafts. A size judged not to pay is measured afresh every `probe_interval` refusals
    (its samples dropped, `min_samples` new ones taken), so a size refused in a loaded stretch
    of a shared host is not refused for good."""

    def __init__(self, window: int = 9, min_samples: int = 3, probe_interval: int = 32) -> None:
        self.window, self.min_samples, self.probe_interval = window, min_samples, probe_interval
        self.plain: dict[int, deque[float]] = {}
        self.verify: dict[int, deque[float]] = {}
        self._refusals: dict[int, int] = {}
        self._last_kind = "prompt"

    def observe(self, kind: str, num_rows: int, num_tokens: int, seconds: float) -> None:
        """A step ran: kind prompt | plain | verify (decode with drafts)."""
        if kind == "verify":
            self._add(self.verify, _bucket(num_tokens), seconds)
        elif kind == "plain" and self._last_kind == "plain":
            self._add(self.plain, _bucket(num_rows), seconds)
        self._last_kind = kind

    def _add(self, table: dict[int, deque[float]], key: int, seconds: float) -> None:
        table.setdefault(key, deque(maxlen=self.window)).append(seconds)

    def pays(self, num_rows: int, num_drafts: int, expected_kept: float) -> bool:
        """Whether a verified step of `num_rows` rows and `num_drafts` drafts, keeping
        `expected_kept` of them, beats a plain step of `num_rows` rows in tokens per second."""
        plain = self.plain.get(_bucket(num_rows))
        if not plain:
            return False
        key = _bucket(num_rows + num_drafts)
        verify = self.verify.get(key)
        if (not verify or len(verify) < self.min_samples
                or statistics.median(verify) * num_rows
                < statistics.median(plain) * (num_rows + expected_kept)):
            return True
        self._refusals[key] = refusals = self._refusals.get(key, 0) + 1
        if refusals >= self.probe_interval:  # measure it afresh: `min_samples` verified steps
            self._refusals[key] = 0
            verify.clear()
            return True
        return False


def draft_masks(grammars, matcher, drafts: Sequence[int]) -> np.ndarray:
    """bool [1 + len(drafts), vocab]: a verified grammar row's mask at each position, the
    matcher walked through the drafts before it and rolled back (its state is unchanged)."""
    masks = [grammars.allowed_tokens(matcher)]
    for token in drafts:
        assert matcher.consume_token(int(token)), (token, matcher.get_error())
        masks.append(grammars.allowed_tokens(matcher))
    matcher.rollback(len(drafts))
    return np.stack(masks)


def row_drafts(sched_out) -> list[list[int]]:
    """Each row's drafts in a decode step (its query tokens after the first)."""
    seqlens_q = np.asarray(sched_out.seqlens_q)
    input_ids = np.asarray(sched_out.input_ids)
    starts = np.cumsum(seqlens_q) - seqlens_q
    return [input_ids[s + 1:s + q].tolist() for s, q in zip(starts, seqlens_q, strict=True)]
