"""Speculative decoding's engine side (torch-free): which requests draft, how many drafts, and
what was accepted.

A speculating request's life, step by step:
1. After a step booked its tokens, `Speculator.propose` asks the request's proposer
   (`baton/engine/proposers.py`) for up to `num_speculative_tokens`; the engine hands the drafts
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
3. `record` counts the drafts and the accepted ones (per position, for /metrics) and updates
   the request's acceptance (its recent rows, decayed). Drafts a step did not verify are
   checked against the tokens its plain steps sample instead and count there too, so a
   request whose rate sank is not judged by its old rows for good.
4. The batch decides (`propose_batch`, `StepCosts.plan`): every row proposes the most drafts,
   `num_speculative_tokens`, and the step verifies the most likely first (a row's draft j is
   kept with chance a^j, a its request's recent acceptance), as many as give the most
   expected tokens per second by the engine's running medians of both step kinds at those
   sizes; where a plain step gives more, no row drafts that step. Extra drafts are nearly
   free on the CPU backend (a verified step's cost is mostly its fixed part), so a long
   draft is cut by its chances, not by a rule of thumb.
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
    # Its own recent drafts and accepted ones, each verified row's weight decaying by
    # _ACCEPTANCE_DECAY: what `kept_chances` judges its next row by.
    drafted: float = 0.0
    accepted: float = 0.0
    # Drafts the batch dropped (verifying would not pay), kept to be checked against the
    # tokens the plain steps sample instead: `shadow_at` is the history's length when they
    # were proposed. A request judged by its rows alone would never learn that it entered a
    # stretch worth drafting once its rate had sunk under the break-even point.
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0

    def learn(self, num_drafts: int, num_accepted: int) -> None:
        """A row's drafts were checked: `num_accepted` of `num_drafts` kept."""
        # A row stops at its first rejection: it tried num_accepted + 1 drafts (all of them
        # when every one was kept).
        tried = min(num_drafts, num_accepted + 1)
        self.drafted = self.drafted * _ACCEPTANCE_DECAY + tried
        self.accepted = self.accepted * _ACCEPTANCE_DECAY + num_accepted

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
    num_shadow_rows: int = 0  # dropped drafts checked against the plain steps' tokens


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
                              len(req.prompt_token_ids))
            self._drafting[req.request_id] = state
        have = len(state.history) - state.num_prompt
        state.history.extend(req.token_ids[have:])
        if state.shadow:
            self._check_shadow(state)
        # The step's sampled token comes on top of the drafts: never draft past max_tokens.
        k = min(self.max_k, req.params.max_tokens - len(req.token_ids) - 1)
        drafts = state.proposer.propose(state.history, k)
        if drafts and req.matcher is not None:  # only what the grammar accepts, state kept
            drafts = drafts[:req.matcher.validate_tokens(drafts)]
        return drafts

    def propose_batch(self, reqs: Sequence[Request], num_rows: int) -> dict[str, list[int]]:
        """Drafts of `reqs` for the next decode step of `num_rows` rows: each row's first ones,
        as many as give the step the most tokens per second by the measured step costs and the
        rows' own acceptance (`StepCosts.plan`), or none at all where a plain step gives more."""
        drafts = {}
        for req in reqs:
            row = self.propose(req)
            if row:
                drafts[req.request_id] = row
        if not drafts:
            return drafts
        num_rows = max(num_rows, len(drafts))
        if self.disable_by_batch_size:
            counts = [len(row) if num_rows < self.disable_by_batch_size else 0
                      for row in drafts.values()]
        else:
            counts = self.costs.plan(num_rows, [self.kept_chances(len(row), request_id)
                                                for request_id, row in drafts.items()])
        kept = {}
        for (request_id, row), n in zip(drafts.items(), counts, strict=True):
            state = self._drafting[request_id]
            if n:
                kept[request_id] = row[:n]
            elif not state.shadow:  # checked against the plain steps' tokens instead
                state.shadow, state.shadow_at = row, len(state.history)
        if not kept:
            self.stats.num_skipped_batches += 1
        return kept

    def kept_chances(self, num_drafts: int, request_id: str) -> list[float]:
        """Each draft's chance to be kept, by the request's own recent acceptance a: a, a^2, ...
        (a draft is kept only after the one before it)."""
        state = self._drafting.get(request_id)
        a = state.acceptance() if state is not None else 0.5
        return [a ** (j + 1) for j in range(min(num_drafts, self.max_k))]

    def _check_shadow(self, state: _Drafting) -> None:
        """Dropped drafts against the tokens sampled since: learnt from as a verified row would
        have been once a token differs or all are matched; until then they wait."""
        came = state.history[state.shadow_at:]
        kept = 0
        for draft, token in zip(state.shadow, came, strict=False):
            if draft != token:
                break
            kept += 1
        if kept < len(came) or kept == len(state.shadow):
            self.stats.num_shadow_rows += 1
            state.learn(len(state.shadow), kept)
            state.shadow = []

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
            state.learn(num_drafts, num_accepted)

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

    `plan` picks how many drafts a step verifies: the count whose expected tokens per second,
    `(B + kept) / verify(B + D)`, is highest, against `B / plain(B)`. A plain step right after
    a verified or a prompt step is not counted (the CPU backend rebuilds a decode row a
    verified step left behind: a cost of switching, paid once whenever the switch comes, so it
    does not decide whether the next step verifies; charging it to every plain step after a
    verified one would keep a row verifying drafts it never keeps, each such step cheaper than
    that one switch). Unmeasured sizes are measured first: no plain step at B yet,
    no drafts (the plain step measures it); fewer than `min_samples` verified ones with every
    draft, every draft; sizes in between are taken linearly from the measured ones (or the
    plain step), an optimistic guess that gets them chosen and measured where they might pay.
    A step with every draft that is refused is measured afresh every `probe_interval` refusals
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

    def plan(self, num_rows: int, chances: Sequence[Sequence[float]]) -> list[int]:
        """How many of its drafts each row verifies in a step of `num_rows` rows (0 everywhere:
        a plain step). `chances[r][j]`: the chance that row r's draft j is kept (they fall with
        j). Drafts are taken most likely first; the count chosen gives the most expected tokens
        (rows + kept) per second of the verified step's cost, against `num_rows` per plain
        step. Unmeasured sizes: see the class."""
        full = [len(row) for row in chances]
        plain = self.plain.get(_bucket(num_rows))
        if not plain:
            return [0] * len(full)
        plain_s = statistics.median(plain)
        key = _bucket(num_rows + sum(full))
        verify = self.verify.get(key)
        if not verify or len(verify) < self.min_samples:
            return full
        measured = {k: statistics.median(v) for k, v in self.verify.items()
                    if len(v) >= self.min_samples}
        order = sorted(((p, r) for r, row in enumerate(chances) for p in row), reverse=True)
        best, best_n, tokens = num_rows / plain_s, 0, float(num_rows)
        for n, (p, _) in enumerate(order, 1):
            tokens += p
            rate = tokens / _between(measured, _bucket(num_rows + n), (num_rows, plain_s))
            if rate > best:
                best, best_n = rate, n
        if best_n == 0:
            self._refusals[key] = refusals = self._refusals.get(key, 0) + 1
            if refusals >= self.probe_interval:  # measure it afresh
                self._refusals[key] = 0
                verify.clear()
                return full
        counts = [0] * len(full)
        for _, r in order[:best_n]:
            counts[r] += 1
        return counts


def _between(measured: dict[int, float], key: int, floor: tuple[int, float]) -> float:
    """A verified step's cost at bucket `key`: measured, else linear between the measured
    buckets around it (`measured` has one above `key`), else between the plain step `floor`
    (its tokens, its cost) and the smallest measured one above: an optimistic guess, which makes
    that size chosen, and measured, where it might pay."""
    if key in measured:
        return measured[key]
    above = min(k for k in measured if k > key)
    below = [k for k in measured if k < key]
    low, low_s = (max(below), measured[max(below)]) if below else floor
    return low_s + (measured[above] - low_s) * (key - low) / (above - low)


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
