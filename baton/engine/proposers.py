"""Model-free draft proposers for speculative decoding (torch-free).

A proposer guesses the next tokens of one request from its own tokens (prompt + outputs): the
model then verifies every guess of a batch in one forward (`baton/engine/speculation.py`).

`NgramProposer` is prompt lookup: the last n tokens (n from `max_n` down to `min_n`) are looked
up among the earlier ones, and the tokens that followed their latest earlier occurrence are the
drafts. The index is incremental: every token is hashed into it once, for each n, so a lookup is
O(max_n) whatever the history's length. Copying from the prompt (a summary, an edit, code) and
the loops a small model falls into are both caught: a draft may run past the end of the history
into the drafts themselves (a loop of period p proposes k tokens, not p).
"""

from __future__ import annotations

from collections.abc import Sequence

# Proposer names the engine accepts (EngineConfig.speculative); "off" means none.
SPECULATIVE_METHODS = ("off", "ngram")


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
                return self._follow(tokens, end, k)
        return []

    def _index(self, tokens: Sequence[int], num: int) -> None:
        """Index the n-grams ending at every position before `num` (the tail's own n-grams
        stay out: a lookup must find an earlier occurrence)."""
        ends = self._ends
        for end in range(max(self._num_indexed, 1), num):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._num_indexed = max(self._num_indexed, num)

    @staticmethod
    def _follow(tokens: Sequence[int], end: int, k: int) -> list[int]:
        """The k tokens after position `end`, reading on into the drafts themselves once the
        history ends (the tail repeats what followed `end`, so the copy goes on periodically)."""
        num = len(tokens)
        drafts: list[int] = []
        for j in range(k):
            pos = end + j
            drafts.append(int(tokens[pos]) if pos < num else drafts[pos - num])
        return drafts
