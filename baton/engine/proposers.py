"""Model-free draft proposers for speculative decoding (torch-free).

A proposer guesses the next tokens of one request from its own tokens (prompt + outputs): the
model then verifies every guess of a batch in one forward (`baton/engine/speculation.py`).

`NgramProposer` is prompt lookup: the last n tokens (n from `max_n` down to `min_n`) are looked
up among the earlier ones, and the tokens that followed their latest earlier occurrence are the
drafts. The index is incremental: every token is hashed into it once, for each n, so a lookup is
O(max_n) whatever the history's length. Copying from the prompt (a summary, an edit, code) and
the loops a small model falls into are both caught: a draft may run past the end of the history
into the drafts themselves (a loop of period p proposes k tokens, not p).

`SuffixProposer` keeps a suffix automaton of the same history (built online, amortised O(1)
per token) and proposes what followed the first earlier occurrence of the *longest* suffix of
the history that occurred before, however long: where the n-gram index stops at 4 tokens and
takes the latest occurrence of that short tail, the suffix match uses all the context that
repeats, so in a text whose short phrases recur with different continuations (a loop over a
list, a template filled several times) it picks the occurrence that matches furthest back.
"""

from __future__ import annotations

from collections.abc import Sequence

# Proposer names the engine accepts (EngineConfig.speculative); "off" means none.
SPECULATIVE_METHODS = ("off", "ngram", "suffix")


class NgramProposer:
    """Prompt lookup over one request's tokens, kept incrementally."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # n-gram -> end (exclusive) of its latest occurrence before the current tail.
        self._ends: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # tokens[:this] have every n-gram ending before it indexed

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` drafts to follow `tokens` (the request's whole history, which only grows
        between calls; a shorter one restarts the index)."""
        if k <= 0:
            return []
        num = len(tokens)
        if num < self._num_indexed:
            self._ends.clear()
            self._num_indexed = 0
        self._index(tokens, num)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[num - n:]))
            if end is not None:
                return follow(tokens, end, k)
        return []

    def _index(self, tokens: Sequence[int], num: int) -> None:
        """Index the n-grams ending at every position before `num` (the tail's own n-grams
        stay out: a lookup must find an earlier occurrence)."""
        ends = self._ends
        for end in range(max(self._num_indexed, 1), num):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._num_indexed = max(self._num_indexed, num)


def follow(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """The k tokens after position `end`, reading on into the drafts themselves once the
    history ends (the tail repeats what followed `end`, so the copy goes on periodically)."""
    num = len(tokens)
    drafts: list[int] = []
    for j in range(k):
        pos = end + j
        drafts.append(int(tokens[pos]) if pos < num else drafts[pos - num])
    return drafts


class SuffixProposer:
    """The longest repeated suffix of one request's tokens, through a suffix automaton.

    State 0 is the empty string; every other state is a class of substrings with the same end
    positions, `_len` the longest of them, `_link` the state of its longest suffix in another
    class, `_end` the end (exclusive) of its first occurrence. The state of the whole history
    is `_last`; its link is the state of the longest suffix that also ends earlier."""

    def __init__(self, min_match: int = 2) -> None:
        if min_match < 1:
            raise ValueError(f"SuffixProposer needs min_match >= 1, got {min_match}")
        self.min_match = min_match
        self._reset()

    def _reset(self) -> None:
        self._next: list[dict[int, int]] = [{}]
        self._link, self._len, self._end = [-1], [0], [0]
        self._last = 0
        self._num = 0  # tokens added

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` drafts to follow `tokens` (the request's whole history, which only grows
        between calls; a shorter one restarts the automaton)."""
        if k <= 0:
            return []
        if len(tokens) < self._num:
            self._reset()
        for token in tokens[self._num:]:
            self._extend(int(token))
        state = self._link[self._last]
        if state <= 0 or self._len[state] < self.min_match:
            return []
        return follow(tokens, self._end[state], k)

    def match_length(self) -> int:
        """Length of the longest suffix of the history seen so far that occurred before."""
        state = self._link[self._last]
        return self._len[state] if state > 0 else 0

    def _new_state(self, length: int, link: int, end: int, nxt: dict[int, int]) -> int:
        self._next.append(nxt)
        self._link.append(link)
        self._len.append(length)
        self._end.append(end)
        return len(self._len) - 1

    def _extend(self, token: int) -> None:
        """The textbook online construction (Blumer et al.): one token at the end."""
        nxt, link, length = self._next, self._link, self._len
        self._num += 1
        cur = self._new_state(length[self._last] + 1, -1, self._num, {})
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: its shorter strings get their own state, ending where q's did
                clone = self._new_state(length[p] + 1, link[q], self._end[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur


def make_proposer(method: str) -> NgramProposer | SuffixProposer:
    """A fresh proposer for one request (`method`: one of SPECULATIVE_METHODS but off)."""
    if method == "ngram":
        return NgramProposer()
    if method == "suffix":
        return SuffixProposer()
    raise ValueError(f"no proposer {method!r}: one of {SPECULATIVE_METHODS[1:]}")
