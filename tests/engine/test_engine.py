"""LLMEngine over the real scheduler and model: exact vs transformers, chunking, preemption,
batching and seeds leave outputs unchanged, and every block comes back."""

from __future__ import annotations

import pytest
import torch
from model.reference import (
    baton_model,
    chat_prompt,
    prompt_of_length,
    reference_greedy,
    truncate_at_eos,
)

from baton.engine import EngineConfig, LLMEngine
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
pytestmark = pytest.mark.slow


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": 128, **overrides}), loaded=baton_model())


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt_of_length(1), prompt_of_length(17), prompt_of_length(300), chat_prompt()]


@pytest.fixture(scope="module")
def greedy_outputs(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.fixture(autouse=True)
def all_blocks_return(engine: LLMEngine):
    yield
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_greedy_batch_matches_transformers(greedy_outputs, prompts) -> None:
    eos = baton_model().config.eos_token_ids
    for got, prompt in zip(greedy_outputs, prompts, strict=False):
        want = truncate_at_eos(reference_greedy(tuple(prompt), MAX_TOKENS), eos)
        assert got == want


def test_each_prompt_alone_equals_the_mixed_batch(engine, greedy_outputs, prompts) -> None:
    for prompt, batched in zip(prompts[:2] + prompts[3:], greedy_outputs[:2] + greedy_outputs[3:], strict=False):
        assert engine.generate(prompt, GREEDY)[0].token_ids == batched


def test_chunked_prefill_equals_unchunked(greedy_outputs, prompts) -> None:
    small = make_engine(max_num_batched_tokens=48)
    assert [o.token_ids for o in small.generate(prompts, GREEDY)] == greedy_outputs
    assert small.num_free_blocks() == small.num_total_blocks()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_preemption_with_recompute_equals_a_large_pool(engine, params) -> None:
    batch = [prompt_of_length(40)[i:] for i in range(0, 12, 2)]  # 6 prompts of 40..30 tokens
    want = [o.token_ids for o in engine.generate(batch, params)]
    tiny = make_engine(num_blocks=14)  # 13 usable blocks; the batch needs 24 at the end
    got = [o.token_ids for o in tiny.generate(batch, params)]
    assert tiny.num_recomputed > 0
    assert got == want
    assert tiny.num_free_blocks() == tiny.num_total_blocks()


def test_same_seed_same_text(engine) -> None:
    text = "Write a short poem about the sea."
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    first = engine.generate([text, "Hello"], [seeded, SamplingParams(temperature=1.0)])[0]
    again = engine.generate(text, seeded)[0]
    assert first.text == again.text and first.token_ids == again.token_ids
    other = engine.generate(text, SamplingParams(temperature=0.9, seed=43, max_tokens=12,
                                                         ignore_eos=True))[0]
    assert other.token_ids != first.token_ids


def test_step_deltas_abort_and_logprobs(engine) -> None:
    rid = engine.add_request("r1", "Tell me a story about a dragon.",
                             SamplingParams(temperature=0, max_tokens=50, logprobs=True,
                                            ignore_eos=True))
    deltas = []
    for _ in range(3):  # one prompt step, then two decode steps
        deltas += [d for d in engine.step() if d.request_id == rid]
    assert len(deltas) == 3 and not any(d.finished for d in deltas)
    assert all(len(d.new_token_ids) == 1 and len(d.new_logprobs) == 1 for d in deltas)
    assert all(lp <= 0 for d in deltas for lp in d.new_logprobs)
    assert engine.abort_request(rid) and not engine.abort_request(rid)
    final = engine.step()
    assert [(d.request_id, d.finished, d.finish_reason) for d in final] == [(rid, True, "abort")]
    assert not engine.has_unfinished()


def test_eos_and_too_long_prompt_finish_cleanly(engine) -> None:
    out = engine.generate(chat_prompt(), SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in baton_model().config.eos_token_ids
    assert "Paris" in out.text
    too_long = [5] * (engine.max_model_len + 1)
    out = engine.generate(too_long, GREEDY)[0]
    assert out.token_ids == [] and out.finish_reason != "length"


def test_decode_rows_across_length_classes(engine) -> None:
    """A 508-token prompt starts decoding in the first length class of the decode rows (<= 512
    tokens) and moves up a class mid-decode (its row gathered again), while short prompts share
    its steps from the first group: two attention groups per step, the same tokens."""
    long_prompt = prompt_of_length(463) + prompt_of_length(45)
    short = [prompt_of_length(1), prompt_of_length(17)]
    gathered = engine.runner.backend.decode_rows.num_gathered
    outs = engine.generate([long_prompt, *short], GREEDY)
    eos = baton_model().config.eos_token_ids
    assert outs[0].token_ids == truncate_at_eos(reference_greedy(tuple(long_prompt), MAX_TOKENS), eos)
    assert len(outs[0].token_ids) == MAX_TOKENS  # long enough to cross 512
    assert engine.runner.backend.decode_rows.num_gathered - gathered == 4  # three rows + one move
    # Rows are masked past their length with an additive -inf, which needs finite keys there:
    # a workspace is zeroed when allocated, never left with what freed memory held.
    for group in engine.runner.backend.decode_rows.groups:
        assert group.ws is None or bool(torch.isfinite(group.ws).all())
    for prompt, out in zip(short, outs[1:], strict=True):
        assert out.token_ids == engine.generate(prompt, GREEDY)[0].token_ids


def _choices(engine: LLMEngine, prompt, params: SamplingParams, abort_after: int = 0) -> dict:
    """Run one request to the end: each choice's (token ids, finish reason)."""
    engine.add_request("n", prompt, params)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    num_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert (out.base_id or out.request_id) == "n"
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                assert out.index not in reasons
                reasons[out.index] = out.finish_reason
        num_steps += 1
        if num_steps == abort_after:
            assert engine.abort_request("n")
    return {i: (tokens.get(i, []), reasons[i]) for i in sorted(reasons)}


def test_n_choices_fork_one_prompt_each_equal_to_its_own_request(engine) -> None:
    """n > 1: one prefill, the other choices forked (shared blocks, cloned tail); choice i is
    token for token the n = 1 request drawing with sample_index i; greedy choices are equal."""
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=5, n=3)
    got = _choices(engine, prompt, seeded)
    assert got == _choices(engine, prompt, seeded)
    alone = [engine.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=5,
                                                    sample_index=i))[0] for i in range(3)]
    assert got == {i: (o.token_ids, o.finish_reason) for i, o in enumerate(alone)}
    assert len({tuple(t) for t, _ in got.values()}) > 1
    greedy = _choices(engine, prompt, SamplingParams(temperature=0, max_tokens=4, n=2))
    assert greedy[0] == greedy[1] == _choices(engine, prompt,
                                              SamplingParams(temperature=0, max_tokens=4))[0]
    capped = _choices(engine, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=1, n=3))
    assert capped == {i: (got[i][0][:1], "length") for i in range(3)}
    aborted = _choices(engine, prompt, SamplingParams(temperature=0, max_tokens=50, n=3,
                                                      ignore_eos=True), abort_after=3)
    assert {r for _, r in aborted.values()} == {"abort"} and len(aborted) == 3


def test_n_choices_whose_first_token_stops_need_no_fork(engine) -> None:
    """A choice that ends at its first token (a stop id) is no sequence; when it is choice 0,
    the prompt's sequence goes on as the next choice instead, each still its own draw."""
    prompt = engine.tokenizer.encode("My favourite colour is")
    for seed in range(20):  # the first seed whose choice 0 starts unlike choices 1 and 2
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=1, n=3)
        firsts = [t[0] for t, _ in _choices(engine, prompt, params).values()]
        if firsts[0] not in firsts[1:]:
            break
    stop = SamplingParams(temperature=1.5, seed=seed, max_tokens=5, n=3,
                          stop_token_ids=(firsts[0],))
    got = _choices(engine, prompt, stop)
    assert got[0] == ([firsts[0]], "stop")
    for i in (1, 2):
        alone = engine.generate(prompt, SamplingParams(temperature=1.5, seed=seed, max_tokens=5,
                                                       sample_index=i,
                                                       stop_token_ids=(firsts[0],)))[0]
        assert got[i] == (alone.token_ids, alone.finish_reason)


def test_decode_steps_run_on_their_own_thread_count(greedy_outputs, prompts) -> None:
    """decode_threads: a step without a prompt runs on its own torch thread count, a prompt
    step on num_threads; the greedy outputs are the same either way."""
    seen = []
    before = torch.get_num_threads()
    try:
        eng = make_engine(num_threads=2, decode_threads=1)
        execute = eng.runner._execute  # the runner sets a step's threads around its forward

        def spy(sched_out, *args):
            seen.append((bool(sched_out.prompt_run), torch.get_num_threads()))
            return execute(sched_out, *args)

        eng.runner._execute = spy
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == greedy_outputs
        assert torch.get_num_threads() == 2  # a step's count does not outlive the step
    finally:
        torch.set_num_threads(before)
    assert {(True, 2), (False, 1)} == set(seen)
    with pytest.raises(ValueError, match="decode_threads"):
        EngineConfig(decode_threads=-1)
