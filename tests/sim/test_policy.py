"""The simulator's stand-in for the router's cache-aware choice (router/engine_pool.py's cost)."""

from __future__ import annotations

import pytest

from simulator.policy import Candidate, OverlapMinusLoad


def test_cost_is_missing_blocks_plus_active_blocks_ties_to_least_loaded():
    p = OverlapMinusLoad(kv_overlap_weight=1.0)
    cands = [Candidate("a", 3, 10, 0), Candidate("b", 1, 2, 8), Candidate("c", 0, 12, 10)]
    # costs: a 10 + 10 = 20, b 2 + 2 = 4, c 0 + 12 = 12
    assert p.choose("normal", 10, cands) == 1
    tie = [Candidate("a", 2, 5, 0), Candidate("b", 1, 5, 0), Candidate("c", 1, 5, 0)]
    assert p.choose("prompt", 4, tie) == 1  # fewest in flight, then the first listed
    assert OverlapMinusLoad(kv_overlap_weight=0.0).choose("normal", 10, cands) == 1
    with pytest.raises(ValueError, match="no completion engine"):
        p.choose("completion", 1, [])
    with pytest.raises(ValueError, match="kv_overlap_weight"):
        OverlapMinusLoad(kv_overlap_weight=-1)
