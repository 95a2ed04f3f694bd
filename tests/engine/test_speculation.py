"""Speculative decoding (baton/engine/speculation.py): n-gram and suffix drafts verified in one
forward give the plain run's tokens (greedy, seeded, grammar-constrained, n > 1 choices),
logprobs within rounding, the plain stops; the verification is rejection sampling (a
statistical test); a batch where verifying would not pay drafts nothing."""

from __future__ import annotations

import random

import llguidance
import numpy as np
import pytest
import torch
from model.reference import LONG_TEXT, baton_model

from baton.engine import EngineConfig, LLMEngine
from baton.engine.proposers import NgramProposer, SuffixProposer, follow
from baton.engine.request import Request
from baton.engine.speculation import Speculator, StepCosts
from baton.model.sampler import Sampler, sample_verified
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

# ---------------------------------------------------------------- the proposer (no model)


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert proposer.propose(history, 3) == [8, 9, 1]
    history += [8, 3, 3]  # the tail (3, 3) was never seen before
    assert proposer.propose(history, 3) == []
    assert proposer.propose([1, 2, 3], 2) == []  # shorter: the index restarts, no match


def test_ngram_runs_on_into_its_own_drafts_for_a_loop() -> None:
    # Period 2: the copy after the earlier (4, 5) runs past the history's end periodically.
    assert NgramProposer().propose([9, 4, 5, 4, 5], 5) == [4, 5, 4, 5, 4]
    assert NgramProposer().propose([9, 4, 5, 4, 5], 0) == []


def test_ngram_prefers_the_longest_match() -> None:
    # (2, 3) last occurred before 9; the longer (1, 2, 3) before 7.
    history = [1, 2, 3, 7, 0, 2, 3, 9, 1, 2, 3]
    assert NgramProposer(min_n=2, max_n=3).propose(history, 1) == [7]
    assert NgramProposer(min_n=2, max_n=2).propose(history, 1) == [9]


def test_suffix_proposes_what_followed_the_longest_repeated_suffix() -> None:
    # The 4-gram (2, 3, 4, 5) last came before 6; the whole tail (1, 2, 3, 4, 5) before 8.
    history = [1, 2, 3, 4, 5, 8, 9, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert NgramProposer().propose(history, 2) == [6, 1]
    assert SuffixProposer().propose(history, 2) == [8, 9]
    assert SuffixProposer().propose([9, 4, 5, 4, 5], 5) == [4, 5, 4, 5, 4]  # a loop runs on
    proposer = SuffixProposer(min_match=3)
    assert proposer.propose([7, 1, 2, 0, 1, 2], 2) == []  # a 2-token match is too short
    assert proposer.propose([7, 1, 2, 0, 1, 2, 0], 2) == [1, 2]  # grown incrementally
    assert proposer.match_length() == 3
    assert proposer.propose([1, 2, 3], 2) == []  # shorter: the automaton restarts


def test_suffix_automaton_matches_a_brute_force_search() -> None:
    """Token by token over random histories: the longest suffix that ended before, its first
    occurrence's continuation."""
    def brute(tokens: list[int], k: int) -> list[int]:
        num = len(tokens)
        for length in range(num - 1, 1, -1):
            for end in range(length, num):
                if tokens[end - length:end] == tokens[num - length:]:
                    return follow(tokens, end, k)
        return []

    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        proposer = SuffixProposer()
        for j in range(1, len(tokens) + 1):
            assert proposer.propose(tokens[:j], 4) == brute(tokens[:j], 4), tokens[:j]


def test_a_batch_over_the_break_even_point_drafts_nothing() -> None:
    """Measured: a plain step of 8 rows 20 ms, verifying 8 rows + 32 drafts 120 ms (6x for at
    most 5x the tokens): the batch drafts nothing. One row: 10 ms plain, 12 ms with 4 drafts:
    it drafts. Unmeasured sizes are measured: plain first, then verified; a stall among the
    measurements moves nothing (medians)."""
    costs = StepCosts(min_samples=1)
    spec = Speculator("suffix", 4, costs)
    loop = [1, 2, 3, 1, 2, 3, 1, 2]
    reqs = [Request(f"r{i}", loop, SamplingParams(max_tokens=50)) for i in range(8)]
    assert spec.propose_batch(reqs, 8) == {}  # no plain average at 8 rows yet
    for kind in ("plain", "plain"):  # the first plain step after another kind is not averaged
        costs.observe(kind, 8, 8, 0.020)
    assert len(spec.propose_batch(reqs, 8)) == 8  # no verified average at 40 tokens: measure
    costs.observe("verify", 8, 40, 0.120)
    costs.observe("verify", 8, 40, 0.020)  # a verified step is never faster than a plain one:
    costs.observe("verify", 8, 40, 0.125)  # but the median of three ignores one outlier
    skipped = spec.stats.num_skipped_batches
    assert spec.propose_batch(reqs, 8) == {}
    assert spec.stats.num_skipped_batches == skipped + 1
    costs.observe("plain", 1, 1, 0.010)
    costs.observe("plain", 1, 1, 0.010)
    costs.observe("verify", 1, 5, 0.012)
    costs.observe("plain", 1, 1, 0.500)  # a stall: the median of 10, 10, 500 ms is 10
    # 3 drafts cost about 11.5 ms (between 10 ms plain and 12 ms with 4): the fourth, kept one
    # time in 16 at a rate of one in two, does not pay its 0.5 ms.
    assert spec.propose_batch(reqs[:1], 1) == {"r0": [3, 1, 2]}
    # A verified step that pays in the plain case's place: 8 rows, 40 tokens, 30 ms.
    for _ in range(9):
        costs.observe("verify", 8, 40, 0.030)
    assert len(spec.propose_batch(reqs, 8)) == 8
    fixed = Speculator("suffix", 4, disable_by_batch_size=8)  # the fixed rule: no timings
    assert fixed.propose_batch(reqs, 8) == {}
    assert len(fixed.propose_batch(reqs[:7], 7)) == 7


def test_each_row_is_judged_by_its_own_requests_acceptance() -> None:
    """A request that kept every draft does not vouch for one that keeps none: one row at
    10 ms plain and 12 ms verified with one draft pays for the first (a draft kept nearly
    always), not for the second (kept about one time in nine after ten rejected rows)."""
    costs = StepCosts(min_samples=1)
    for kind in ("plain", "plain"):
        costs.observe(kind, 1, 1, 0.010)
    costs.observe("verify", 1, 2, 0.012)
    spec = Speculator("suffix", 1, costs)
    loop = [1, 2, 3, 1, 2, 3, 1, 2]
    good, bad = (Request(name, loop, SamplingParams(max_tokens=500)) for name in "gb")
    for req, kept in ((good, 1), (bad, 0)):
        assert spec.propose(req)  # it has a draft to offer, and a state to learn in
        for _ in range(10):
            spec.record(req.request_id, 1, kept)
    assert sum(spec.kept_chances(1, "g")) > 0.85 and sum(spec.kept_chances(1, "b")) < 0.15
    assert spec.propose_batch([good], 1) == {"g": [3]}
    assert spec.propose_batch([bad], 1) == {}
    assert sum(spec.kept_chances(1, "new")) == 0.5  # a request with no history: one in two
    spec.record("b", 1, 1)  # it keeps drafts again: its rate climbs back
    assert sum(spec.kept_chances(1, "b")) > 0.15


def test_dropped_drafts_are_checked_against_the_plain_tokens() -> None:
    """A request whose rate sank under the break-even point learns from the drafts the batch
    dropped: they wait for the tokens the plain steps sample, are judged as a verified row would
    have been (kept up to the first differing token), and once they are kept again the request
    drafts again. The verified counters count verified rows only."""
    costs = StepCosts(min_samples=1)
    for kind in ("plain", "plain"):
        costs.observe(kind, 1, 1, 0.010)
    costs.observe("verify", 1, 3, 0.018)  # 2 drafts: 18 ms; 1 draft taken as 14 ms
    costs.observe("plain", 1, 1, 0.010)
    spec = Speculator("suffix", 2, costs)
    req = Request("r", [5, 6, 7, 8, 9, 4, 5, 6], SamplingParams(max_tokens=500))
    assert spec.propose(req) == [7, 8]
    for _ in range(10):
        spec.record("r", 2, 0)
    assert sum(spec.kept_chances(2, "r")) < 0.15
    assert spec.propose_batch([req], 1) == {}  # [7, 8] dropped: it waits for the tokens
    req.token_ids.append(7)  # the first equals its draft: not judged yet
    assert spec.propose_batch([req], 1) == {} and spec.stats.num_shadow_rows == 0
    before = sum(spec.kept_chances(2, "r"))
    req.token_ids.append(8)  # both kept: the rate climbs; [9, 4] dropped in turn
    assert spec.propose_batch([req], 1) == {} and spec.stats.num_shadow_rows == 1
    assert sum(spec.kept_chances(2, "r")) > before
    before = sum(spec.kept_chances(2, "r"))
    req.token_ids.append(3)  # differs from the first: none kept
    spec.propose_batch([req], 1)
    assert spec.stats.num_shadow_rows == 2 and sum(spec.kept_chances(2, "r")) < before
    for token in [5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 4, 5, 6]:  # a copy: every dropped row kept
        req.token_ids.append(token)
        if spec.propose_batch([req], 1):
            break
    else:
        raise AssertionError("a request that keeps its dropped drafts never drafts again")
    assert spec.stats.num_drafted == 20 and spec.stats.num_accepted == 0  # verified rows only


def test_a_refused_size_is_probed_again() -> None:
    """Verified steps are measured `min_samples` times before they can be refused; a refused
    size is measured afresh every `probe_interval` refusals (its old samples dropped)."""
    costs = StepCosts(min_samples=2, probe_interval=3)
    costs.observe("plain", 2, 2, 0.01)
    costs.observe("plain", 2, 2, 0.01)
    costs.observe("verify", 2, 10, 1.0)
    chances = [[0.3, 0.1, 0.05, 0.05]] * 2
    full = [4, 4]
    assert costs.plan(2, chances) == full  # one sample: measure again
    costs.observe("verify", 2, 10, 1.0)
    assert [costs.plan(2, chances) for _ in range(3)] == [[0, 0], [0, 0], full]
    assert costs.plan(2, chances) == full  # no sample since the probe: measuring
    for _ in range(2):  # the stall that made it slow has gone: 12 ms against 10 ms plain
        costs.observe("verify", 2, 10, 0.012)
        costs.observe("plain", 2, 2, 1.0)  # the plain step after a verified one: not counted
    assert all(sum(costs.plan(2, chances)) for _ in range(5))


def test_drafts_are_cut_where_the_next_one_would_not_pay() -> None:
    """A step's drafts, most likely first, as many as give the most expected tokens per second:
    plain 10 ms a row, 4 drafts 16 ms (sizes between taken linearly). A row that keeps most
    drafts verifies all 4, one that keeps few verifies 1, one that keeps almost none none,
    even right after a verified step whose switch back to plain steps is dear. Of two rows,
    the likely one's drafts go first."""
    costs = StepCosts(min_samples=1)
    for kind in ("plain", "plain"):
        costs.observe(kind, 1, 1, 0.010)
    costs.observe("verify", 1, 5, 0.016)
    costs.observe("plain", 1, 1, 0.010)
    assert costs.plan(1, [[0.9, 0.81, 0.73, 0.66]]) == [4]
    assert costs.plan(1, [[0.3, 0.09, 0.03, 0.01]]) == [1]
    assert costs.plan(1, [[0.05, 0.0025, 0.0, 0.0]]) == [0]
    costs.observe("verify", 1, 5, 0.016)
    costs.observe("plain", 1, 1, 0.020)  # the switch back: paid once, whenever it comes
    costs.observe("verify", 1, 5, 0.016)
    assert costs.plan(1, [[0.05, 0.0025, 0.0, 0.0]]) == [0]
    for kind in ("plain", "plain"):
        costs.observe(kind, 2, 2, 0.012)
    costs.observe("verify", 2, 10, 0.030)
    assert costs.plan(2, [[0.9, 0.81, 0.73, 0.66], [0.2, 0.04, 0.01, 0.0]]) == [4, 0]


def test_drafts_stop_at_the_limits() -> None:
    """Every step proposes the most drafts (the plan cuts them); none past max_tokens, none for
    a request that opts out or an n > 1 prompt not split into its choices yet."""
    spec = Speculator("ngram", 4)
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50))
    assert spec.propose(req) == [3, 1, 2, 3]
    spec.record("r", 4, 1)
    assert spec.propose(req) == [3, 1, 2, 3]
    req.token_ids.extend([3, 1])
    assert spec.propose(req) == [2, 3, 1, 2]  # the history grew by the outputs
    spec.record("r", 3, 0)
    req.params.max_tokens = 4  # the step's own token comes on top: no draft past max_tokens
    assert spec.propose(req) == [2]
    req.params.max_tokens = 3
    assert spec.propose(req) == []
    assert spec.propose(Request("x", [1, 2, 1, 2], SamplingParams(speculative=False))) == []
    assert spec.propose(Request("y", [1, 2, 1, 2], SamplingParams(n=2), is_split=False)) == []
    assert spec.propose(Request("z", [1, 2, 1, 2], SamplingParams(n=2))) == [1, 2, 1, 2]
    assert spec.stats.num_drafted == 7 and spec.stats.num_accepted == 1
    assert spec.stats.accepted_per_pos == [1, 0, 0, 0]


# ---------------------------------------------------------------- verification (sampler only)


def test_verification_is_rejection_sampling() -> None:
    """Draft d against p: kept with probability p(d); a rejected position's token follows p
    with d removed, renormalised; the first token's marginal is p (fixed seed)."""
    torch.manual_seed(1234)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draft, trials = 2, 20000
    logits = p.log().repeat(2 * trials, 1)  # two positions a row: draft 1 and the token after
    params = [SamplingParams(temperature=1.0)] * trials
    tokens, _, kept = sample_verified(Sampler(), logits, params, [[0]] * trials,
                                      [[]] * trials, [[draft]] * trials)
    kept = np.asarray(kept)
    assert abs(kept.mean() - p[draft].item()) < 0.015
    rejected = tokens[kept == 0, 0]
    residual = np.bincount(rejected, minlength=4) / len(rejected)
    want = p.clone()
    want[draft] = 0
    want /= want.sum()
    assert np.abs(residual - want.numpy()).max() < 0.015
    first = np.where(kept == 1, draft, tokens[:, 0])
    assert np.abs(np.bincount(first, minlength=4) / trials - p.numpy()).max() < 0.015


def test_a_seeded_row_draws_its_plain_tokens() -> None:
    """Each position draws with the seed's uniform of its output position: the kept drafts and
    the token after them are what plain seeded decoding samples there."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=0.9, seed=7)
    sampler, outputs = Sampler(), [3, 4]
    plain = []
    for j in range(4):
        ids, _ = sampler(logits[j:j + 1], [params], prompt_token_ids=[[1]],
                         output_token_ids=[outputs + plain])
        plain.append(int(ids[0]))
    drafts = [plain[0], plain[1], (plain[2] + 1) % 50]  # the third is wrong
    tokens, _, kept = sample_verified(sampler, logits, [params], [[1]], [outputs], [drafts])
    assert kept == [2]
    assert tokens[0].tolist() == [plain[2], plain[0], plain[1], -1]


# ---------------------------------------------------------------- the engine, real model

COPY_PROMPT_TEXT = LONG_TEXT[:700] + " " + LONG_TEXT[:160]


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": 96, **overrides}), loaded=baton_model())


def speculating(method: str = "ngram", **overrides) -> LLMEngine:
    """A speculating engine that drafts whatever its step times (the exactness tests must not
    depend on timings): a fixed batch limit instead of the cost model."""
    return make_engine(speculative=method, num_speculative_tokens=4,
                       speculative_disable_by_batch_size=1000, **overrides)


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    return make_engine(), speculating()


@pytest.fixture(scope="module")
def copy_prompt() -> list[int]:
    return baton_model().tokenizer.encode(COPY_PROMPT_TEXT)


@pytest.fixture(autouse=True)
def all_blocks_return(request):
    yield
    if "engines" in request.fixturenames:
        for eng in request.getfixturevalue("engines"):
            assert eng.num_free_blocks() == eng.num_total_blocks()


def run_both(engines, prompts, params):
    plain, spec = engines
    before = spec.speculator.stats.num_accepted
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    return want, got, spec.speculator.stats.num_accepted - before


@pytest.mark.slow
def test_greedy_equals_plain_decoding_token_for_token(engines, copy_prompt) -> None:
    """Greedy with logprobs and top logprobs: the same tokens; logprobs within rounding (the
    verified positions attend as a short chunk, the plain ones over the dense decode rows)."""
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=True, top_logprobs=2)
    prompts = [copy_prompt, baton_model().tokenizer.encode("1, 2, 3, 4,")]
    want, got, accepted = run_both(engines, prompts, params)
    assert accepted > 10  # the copy was drafted and kept
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-3)


@pytest.mark.slow
def test_verified_drafts_extend_the_decode_rows(engines, copy_prompt) -> None:
    """A step that verifies drafts keeps each sequence's dense decode row (its tokens before
    the drafts; beside rows that decode plainly in the same step), and the next plain step
    appends the kept drafts' K/V from the pool: a whole row is gathered once per sequence, when
    it first decodes, and the tokens are the plain run's."""
    tokenizer = baton_model().tokenizer
    prompts = [copy_prompt, tokenizer.encode("1, 2, 3, 4,"),
               tokenizer.encode("The cat sat on the mat. The cat sat on")]
    rows = engines[1].runner.backend.decode_rows
    gathered, appended = rows.num_gathered, rows.num_appended
    want, got, accepted = run_both(engines, prompts, SamplingParams(temperature=0, max_tokens=48))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert accepted > 10
    assert rows.num_gathered - gathered <= len(prompts)
    assert rows.num_appended - appended > len(prompts)


@pytest.mark.slow
def test_stops_and_lengths_as_without_drafts(engines, copy_prompt) -> None:
    """max_tokens cuts inside a verified row, a stop token among the kept drafts ends the
    output there, ignore_eos runs on; penalties see the drafts before each position."""
    plain, _ = engines
    run = plain.generate(copy_prompt, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    cases = [SamplingParams(temperature=0, max_tokens=7),
             SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(run[9],)),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            frequency_penalty=0.5, min_tokens=5)]
    for params in cases:
        want, got, _ = run_both(engines, [copy_prompt], params)
        assert got[0].token_ids == want[0].token_ids, params
        assert got[0].finish_reason == want[0].finish_reason


@pytest.mark.slow
def test_seeded_sampling_repeats_the_plain_run(engines, copy_prompt) -> None:
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=20)
    want, got, accepted = run_both(engines, [copy_prompt], params)
    assert got[0].token_ids == want[0].token_ids
    assert accepted > 0


@pytest.mark.slow
def test_choices_draft_and_the_opt_out_does_not(engines, copy_prompt) -> None:
    """n > 1 seeded choices draft once split, a request that opts out never; both give the
    plain output."""
    _, spec = engines
    cases = [SamplingParams(temperature=0, max_tokens=8, speculative=False),
             SamplingParams(temperature=0.5, seed=3, max_tokens=12, n=2)]
    for params in cases:
        rows_before = spec.speculator.stats.num_verify_rows
        outs = []
        for eng in engines:
            rid = eng.add_request(None, copy_prompt, params)
            done: dict[int, list[int]] = {}
            while eng.has_unfinished():
                for out in eng.step():
                    if out.request_id.startswith(rid) or out.base_id == rid:
                        done.setdefault(out.index, []).extend(out.new_token_ids)
            outs.append(done)
        assert outs[0] == outs[1]
        assert (spec.speculator.stats.num_verify_rows > rows_before) == params.speculative


@pytest.mark.slow
def test_suffix_greedy_equals_plain_decoding(engines, copy_prompt) -> None:
    """--speculative suffix: the copy and a prompt this model loops on, the plain tokens."""
    plain, _ = engines
    suffix = speculating("suffix")
    loop = baton_model().tokenizer.encode("The cat sat on the mat. The cat")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, got, accepted = run_both((plain, suffix), [copy_prompt, loop], params)
    assert accepted > 8
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert suffix.num_free_blocks() == suffix.num_total_blocks()


@pytest.mark.slow
def test_drafts_stop_where_the_grammar_would_refuse(engines) -> None:
    """A grammar row drafts only the prefix its matcher accepts, and the check leaves the
    matcher where it was."""
    _, spec = engines
    tok = baton_model().tokenizer
    x, y = tok.encode(" x"), tok.encode(" y")
    assert len(x) == len(y) == 1
    matcher = spec.inputs.grammars.matcher(llguidance.LLMatcher.grammar_from_regex(" y x"))
    req = Request("g", (x + y) * 2 + x, SamplingParams(max_tokens=50), matcher=matcher)
    assert spec.speculator.propose(req) == y + x  # the n-gram copy: y x y x, cut after x
    assert matcher.consume_token(y[0]) and matcher.consume_token(x[0])
    spec.speculator.forget("g")


@pytest.mark.slow
def test_grammar_constrained_drafts_give_the_plain_output(engines, copy_prompt) -> None:
    """Each verified position of a grammar row is sampled under the mask after the drafts
    before it: greedy and seeded outputs are the plain ones, and drafts were kept."""
    grammar = llguidance.LLMatcher.grammar_from_regex("[A-Za-z ,.:-]+")
    cases = [SamplingParams(temperature=0, max_tokens=16, grammar=grammar),
             SamplingParams(temperature=0.7, seed=5, max_tokens=16, grammar=grammar)]
    for params in cases:
        want, got, accepted = run_both(engines, [copy_prompt], params)
        assert got[0].token_ids == want[0].token_ids
        assert got[0].finish_reason == want[0].finish_reason
        assert accepted > 0


def test_config_refuses_what_speculation_cannot_do() -> None:
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens=3 with speculative='off'"):
        EngineConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size=4 with spec"):
        EngineConfig(speculative_disable_by_batch_size=4)
    with pytest.raises(ValueError, match="on a prompt engine"):
        EngineConfig(speculative="ngram", engine_type="prompt")
    assert EngineConfig(speculative="ngram").num_draft_tokens == 8
    with pytest.raises(ValueError, match="speculative must be a bool"):
        SamplingParams(speculative=1)


def test_flags_on_the_engines_that_decode(capsys) -> None:
    from baton_cli.engine_main import engine_config
    from baton_cli.launch_config import role_engine_args
    from baton_cli.main import build_parser

    flags = ["--speculative", "suffix", "--num-speculative-tokens", "2",
             "--speculative-disable-by-batch-size", "8"]
    for command, role in (("engine", "normal"), ("completion-engine", "completion")):
        config = engine_config(build_parser().parse_args([command, *flags]), role)
        assert (config.speculative, config.num_draft_tokens) == ("suffix", 2)
        assert config.speculative_disable_by_batch_size == 8
        assert role_engine_args(flags, role) == flags  # baton up forwards them
    assert engine_config(build_parser().parse_args(["engine"]), "normal").num_draft_tokens == 0
    assert role_engine_args(flags, "prompt") == []
    # A completion engine changing role to prompt (S41) builds a prompt engine's config.
    args = build_parser().parse_args(["completion-engine", *flags])
    assert engine_config(args, "prompt").num_draft_tokens == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prompt-engine", "--speculative", "suffix"])
    assert "unrecognized arguments: --speculative suffix" in capsys.readouterr().err


@pytest.mark.slow
def test_metrics_count_drafts_by_position(engines, copy_prompt) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from baton.protocol import EngineStats
    from baton.service.metrics import EngineMetrics
    from baton.service.worker import EngineWorker

    _, spec = engines
    spec.generate(copy_prompt, SamplingParams(temperature=0, max_tokens=12))
    stats = EngineStats(engine_id="e1", role="normal")
    EngineWorker(spec).fill_stats(stats)
    metrics = EngineMetrics("e1", "normal")
    metrics.publish(stats)
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}
    counts = spec.speculator.stats
    assert samples[("baton_spec_drafted_tokens_total", None)] == counts.num_drafted > 0
    assert samples[("baton_spec_accepted_tokens_total", None)] == counts.num_accepted > 0
    per_pos = [samples[("baton_spec_accepted_tokens_per_pos_total", str(j))] for j in range(4)]
    assert sum(per_pos) == counts.num_accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is kept only after the one before
    assert samples[("baton_spec_drafted_tokens_per_pos_total", "0")] == counts.num_verify_rows


@pytest.mark.slow
def test_greedy_equals_plain_over_a_bfloat16_pool(copy_prompt) -> None:
    """--kv-cache-dtype bfloat16: the verified positions read the pool's rounded K/V, the plain
    ones the decode rows' (rounded the same way), so the tokens still match."""
    plain = make_engine(kv_cache_dtype="bfloat16")
    spec = speculating(kv_cache_dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=32)
    want, got, accepted = run_both((plain, spec), [copy_prompt], params)
    assert accepted > 10
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for eng in (plain, spec):
        assert eng.num_free_blocks() == eng.num_total_blocks()
