"""The selection policies on plain data, as a simulator calls them: engine ids, the block keys
each holds (a dict of sets, or the router's KvIndex fed one snapshot), their loads. No router,
no engines, no sockets. The keys are the engines' own (baton/engine/block_keys.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.protocol import COMPLETION, NORMAL, PROMPT, KvEvents, pack_keys
from router.kv_index import KvIndex, RequestKeys
from router.selection import Candidate, Choice, KeySets, LeastLoaded, OverlapMinusLoad

BS = 4
SEED = 4242
TOKENS = list(range(100, 140))  # 10 blocks of 4


def _keys(tokens: list[int] = TOKENS) -> list[int]:
    return RequestKeys(tokens).keys_for(BS, SEED)


def _policy(held: dict[str, set[int]], weight: float = 1.0) -> OverlapMinusLoad:
    return OverlapMinusLoad(KeySets(held, BS, SEED), weight)


def test_least_loaded_takes_the_lowest_load_and_ignores_the_caches() -> None:
    candidates = [Candidate("a", load=3.0), Candidate("b", load=1.5), Candidate("c", load=2.0)]
    assert LeastLoaded().select(PROMPT, candidates, RequestKeys(TOKENS)) == Choice("b", 0, 0)


def test_least_loaded_tie_goes_to_the_first_listed() -> None:
    candidates = [Candidate("a", load=2.0), Candidate("b", load=1.0), Candidate("c", load=1.0)]
    assert LeastLoaded().select(NORMAL, candidates, RequestKeys(TOKENS)).engine_id == "b"
    assert LeastLoaded().select(NORMAL, candidates[::-1], RequestKeys(TOKENS)).engine_id == "c"


def test_held_blocks_win_until_the_active_blocks_outweigh_them() -> None:
    policy = _policy({"b": set(_keys()[:6])})
    request = RequestKeys(TOKENS)
    # a: 10 new blocks, cost 10; b: 4 new blocks, cost 4; a prompt engine computes the 4.
    assert policy.select(PROMPT, [Candidate("a"), Candidate("b")], request) == Choice("b", 4, 6)
    # b has 6 active blocks: 4 + 6 = 10 = a's cost, the tie goes to the lower load (a's 0).
    busy = [Candidate("a"), Candidate("b", load=1.0, num_active_blocks=6)]
    assert policy.select(PROMPT, busy, request) == Choice("a", 10, 0)
    busy = [Candidate("a"), Candidate("b", num_active_blocks=7)]  # 11 > 10
    assert policy.select(PROMPT, busy, request) == Choice("a", 10, 0)


def test_a_completion_engine_keeps_every_block_of_the_request() -> None:
    policy = _policy({"b": set(_keys()[:6])})
    for role in (COMPLETION, NORMAL):
        choice = policy.select(role, [Candidate("a"), Candidate("b")], RequestKeys(TOKENS))
        assert choice == Choice("b", 10, 6)


def test_the_overlap_weight_prices_a_held_block() -> None:
    held = {"b": set(_keys()[:6])}
    candidates = [Candidate("a"), Candidate("b", num_active_blocks=7)]
    request = RequestKeys(TOKENS)
    # weight 1: a 10 vs b 4 + 7 = 11 -> a; weight 2: a 20 vs b 8 + 7 = 15 -> b.
    assert _policy(held, 1.0).select(PROMPT, candidates, request).engine_id == "a"
    assert _policy(held, 2.0).select(PROMPT, candidates, request).engine_id == "b"
    # weight 0: only the active blocks count, the caches not at all.
    assert _policy(held, 0.0).select(PROMPT, candidates, request) == Choice("a", 10, 0)


def test_ties_go_to_the_least_loaded_then_the_first_listed() -> None:
    policy = _policy({})
    request = RequestKeys(TOKENS)
    candidates = [Candidate("a", load=2.0), Candidate("b", load=1.0), Candidate("c", load=1.0)]
    assert policy.select(PROMPT, candidates, request).engine_id == "b"
    assert policy.select(PROMPT, candidates[::-1], request).engine_id == "c"


def test_only_a_leading_run_of_held_blocks_counts() -> None:
    keys = _keys()
    policy = _policy({"a": set(keys[1:]), "b": {keys[0], keys[1], keys[3]}})
    choice = policy.select(PROMPT, [Candidate("a"), Candidate("b")], RequestKeys(TOKENS))
    assert choice == Choice("b", 8, 2)  # a holds 9 blocks but not the first: no prefix hit


def test_an_engine_the_cache_view_does_not_know_is_counted_at_its_own_block_size() -> None:
    policy = OverlapMinusLoad(KvIndex())  # no engine has sent its snapshot yet
    # 40 tokens: 5 blocks of 8 against 10 blocks of 4, no overlap anywhere.
    candidates = [Candidate("a", block_size=4), Candidate("b", block_size=8)]
    assert policy.select(PROMPT, candidates, RequestKeys(TOKENS)) == Choice("b", 5, 0)


def test_the_router_kv_index_is_a_cache_view() -> None:
    index = KvIndex()
    assert index.apply("tcp://b", KvEvents("inst", 1, is_snapshot=True,
                                           stored=pack_keys(_keys()[:6]), block_size=BS,
                                           seed=SEED, num_total_blocks=64))
    policy = OverlapMinusLoad(index)
    candidates = [Candidate("tcp://a", block_size=BS), Candidate("tcp://b", block_size=99)]
    # b's block size is the index's (4), not the candidate's; a, unindexed, keys by its own.
    assert policy.select(PROMPT, candidates, RequestKeys(TOKENS)) == Choice("tcp://b", 4, 6)


@pytest.mark.parametrize("weight", [-1.0, float("inf"), float("nan")])
def test_a_bad_overlap_weight_is_refused_by_value(weight: float) -> None:
    with pytest.raises(ValueError, match="overlap_weight"):
        OverlapMinusLoad(KeySets({}, BS, SEED), weight)


_engine = st.tuples(st.integers(0, 10), st.integers(0, 12), st.integers(0, 3))


@settings(max_examples=200, deadline=None)
@given(engines=st.lists(_engine, min_size=1, max_size=6), weight=st.sampled_from([0, 0.5, 1, 2]),
       role=st.sampled_from([PROMPT, COMPLETION]))
def test_the_choice_is_the_first_lowest_cost_then_load(engines, weight, role) -> None:
    """Random engines (held leading blocks, active blocks, load): the policy's choice is the
    formula's, ties by load and then by order."""
    keys = _keys()
    held = {f"e{i}": set(keys[:num_held]) for i, (num_held, _, _) in enumerate(engines)}
    candidates = [Candidate(f"e{i}", load=float(load), num_active_blocks=active)
                  for i, (_, active, load) in enumerate(engines)]
    ranked = sorted(range(len(engines)), key=lambda i: (
        weight * (10 - engines[i][0]) + engines[i][1], engines[i][2], i))
    best = ranked[0]
    num_held = engines[best][0]
    expected = Choice(f"e{best}", 10 - num_held if role == PROMPT else 10, num_held)
    assert _policy(held, weight).select(role, candidates, RequestKeys(TOKENS)) == expected
