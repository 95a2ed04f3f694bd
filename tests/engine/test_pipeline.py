"""The two-beat pipeline (`async_scheduling`, baton/engine/pipeline.py; docs/scheduler.md S3,
S8, S29): step N+1 scheduled with -1 placeholders and launched while step N runs gives the
one-beat engine's outputs token for token (greedy with logprobs, stops, n = 2, seeded
sampling, a request aborted mid-stream), on a NORMAL engine and on a completion engine fed
by a prompt engine; every block returns, and close() stops its thread."""

from __future__ import annotations

import numpy as np
import pytest
from model.reference import LONG_TEXT, baton_model

from baton.engine import EngineConfig, LLMEngine
from baton.engine.pipeline import FilledStep, StepLaunch, fill_placeholders
from baton.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=14, logprobs=True, top_logprobs=2)


def make_engine(**overrides) -> LLMEngine:
    # One thread: on a busy host a two-thread step on the main thread can be several times
    # slower than on the forward thread (README, The two-beat pipeline); the outputs are alike.
    return LLMEngine(EngineConfig(**{"num_blocks": 96, "num_threads": 1, **overrides}),
                     loaded=baton_model())


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    return make_engine(), make_engine(async_scheduling=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = baton_model().tokenizer
    return [tok.encode(LONG_TEXT[:300]), tok.encode("1, 2, 3, 4,"),
            tok.encode("The capital of France is")]


def run(engine: LLMEngine, prompts, params_list, abort_at: dict[int, int] | None = None
        ) -> dict[tuple[int, int], tuple[list[int], list[float], str | None]]:
    """(prompt, choice) -> (tokens, logprobs, finish reason), stepping by hand; `abort_at`:
    prompt -> the step after which it is aborted."""
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params_list, strict=True)]
    index = {rid: i for i, rid in enumerate(ids)}
    done: dict[tuple[int, int], tuple[list[int], list[float], str | None]] = {}
    num_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            i = index[out.base_id or out.request_id]
            tokens, lps, _ = done.setdefault((i, out.index), ([], [], None))
            tokens.extend(out.new_token_ids)
            lps.extend(out.new_logprobs or [])
            if out.finished:
                done[(i, out.index)] = (tokens, lps, out.finish_reason)
        num_steps += 1
        for i, when in (abort_at or {}).items():
            if when == num_steps:
                engine.abort_request(ids[i])
        assert num_steps < 500
    assert engine.num_free_blocks() == engine.num_total_blocks()
    return done


@pytest.mark.slow
def test_two_beats_give_the_one_beat_outputs(engines, prompts) -> None:
    """Greedy with logprobs and top logprobs, a stop token, max_tokens, a seeded draw and
    n = 2 choices, in one batch: the same tokens and finish reasons, logprobs alike."""
    plain, piped = engines
    stop = plain.generate(prompts[1], SamplingParams(temperature=0, max_tokens=7))[0].token_ids[6]
    cases = [GREEDY, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop,)),
             SamplingParams(temperature=0.8, seed=5, max_tokens=12, n=2)]
    before = piped.pipeline.num_two_beat_steps
    want, got = run(plain, prompts, cases), run(piped, prompts, cases)
    assert piped.pipeline.num_two_beat_steps - before > 8  # it did run steps ahead
    assert set(got) == set(want) == {(0, 0), (1, 0), (2, 0), (2, 1)}
    for key in want:
        assert got[key][0] == want[key][0], key
        assert got[key][2] == want[key][2], key
        np.testing.assert_allclose(got[key][1], want[key][1], atol=1e-5)
    assert want[(1, 0)][2] == "stop" and want[(1, 0)][0][-1] == stop


@pytest.mark.slow
def test_abort_mid_stream_and_close(engines, prompts) -> None:
    """A request aborted while its next step is in flight ends with 'abort'; the others go on
    as without the pipeline; close() books the step in flight and stops the thread."""
    plain, piped = engines
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
    want = run(plain, prompts, params, abort_at={1: 4})
    got = run(piped, prompts, params, abort_at={1: 4})
    assert got == want and got[(1, 0)][2] == "abort"
    engine = make_engine(async_scheduling=True)
    rid = engine.add_request(None, prompts[0], params[0])
    for _ in range(4):
        engine.step()
    assert engine.pipeline.in_flight
    engine.abort_request(rid)  # its blocks wait for the step in flight (S8)
    assert engine.num_free_blocks() < engine.num_total_blocks()
    engine.close()
    assert not engine.pipeline.in_flight
    assert engine.num_free_blocks() == engine.num_total_blocks()
    assert all(not t.is_alive() for t in engine.pipeline._pool._threads)


@pytest.mark.slow
def test_speculating_rows_run_one_beat_beside_two_beat_opt_outs(engines, prompts) -> None:
    """--speculative with --async-scheduling: a batch with a speculating request runs one beat
    (its drafts verified), a batch of opt-outs two beats; both give the plain tokens."""
    plain, _ = engines
    spec = make_engine(async_scheduling=True, speculative="ngram", num_speculative_tokens=4,
                       speculative_disable_by_batch_size=1000)
    copy = baton_model().tokenizer.encode(LONG_TEXT[:200] + " " + LONG_TEXT[:100])
    for opt_in in (True, False):
        params = SamplingParams(temperature=0, max_tokens=12, speculative=opt_in)
        beats, verified = spec.pipeline.num_two_beat_steps, spec.speculator.stats.num_verify_rows
        assert run(spec, [copy, prompts[1]], [params] * 2) == \
            run(plain, [copy, prompts[1]], [params] * 2)
        assert (spec.pipeline.num_two_beat_steps > beats) != opt_in
        assert (spec.speculator.stats.num_verify_rows > verified) == opt_in


@pytest.mark.slow
def test_a_request_runs_to_the_model_length(prompts) -> None:
    """The step whose row reaches the model length runs one beat: no row past it (S38)."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    got = [run(make_engine(max_model_len=len(prompts[1]) + 6, async_scheduling=mode),
               prompts[1:2], [params])[(0, 0)] for mode in (False, True)]
    assert got[0] == got[1] and got[0][2] == "length"


def disaggregated(completion: LLMEngine, prompt_engine: LLMEngine, prompts, params):
    """Each prompt prefilled on `prompt_engine`, its KV copied into `completion`'s blocks, then
    decoded there: tokens per prompt (the prompt engine's first, then the completion's)."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"pd-{i}"
        prompt_engine.add_request(rid, prompt, params)
        first = None
        while first is None:
            first = next((o for o in prompt_engine.step() if o.handed_off_block_ids), None)
        data = prompt_engine.runner.read_blocks(np.asarray(first.handed_off_block_ids))
        alloc = completion.add_prompted_request(rid, prompt, [], params,
                                                first.new_token_ids[0], first.new_logprobs[0])
        completion.runner.write_blocks(alloc.block_ids, data[:len(alloc.block_ids)])
        completion.commit_prompted(rid)
        prompt_engine.release_handed_off(rid)
        tokens[rid] = [first.new_token_ids[0]]
    while completion.has_unfinished():
        for out in completion.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert completion.num_free_blocks() == completion.num_total_blocks()
    return tokens


@pytest.mark.slow
def test_completion_engine_two_beats_give_the_normal_engines_tokens(engines, prompts) -> None:
    plain, _ = engines
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=True)
    want = run(plain, prompts, [params] * 3)
    prompt_engine = make_engine(engine_type="prompt")
    got = disaggregated(make_engine(engine_type="completion", async_scheduling=True),
                        prompt_engine, prompts, params)
    assert got == {f"pd-{i}": want[(i, 0)][0] for i in range(len(prompts))}


def test_placeholders_are_filled_from_the_step_in_flight() -> None:
    class Out:  # a decode step of seqs 7 (-1: sampled by the step in flight) and 9
        input_ids = np.array([-1, 42], dtype=np.int32)
        seqlens_q = np.array([1, 1], dtype=np.int32)
        prompt_run = False

    prev = StepLaunch(None, np.array([3, 7]), [], np.array([1, 1]), False, ())
    step, filled = fill_placeholders(Out(), np.array([7, 9]), prev, np.array([5, 11]))
    assert isinstance(step, FilledStep) and list(step.input_ids) == [11, 42]
    assert filled == {7: 11} and step.prompt_run is False
    with pytest.raises(AssertionError, match="waits on no step"):
        fill_placeholders(Out(), np.array([8, 9]), prev, np.array([5, 11]))


def test_flag_on_the_engines_that_decode(capsys) -> None:
    from baton_cli.engine_main import engine_config
    from baton_cli.launcher import role_engine_args
    from baton_cli.main import build_parser

    for command, role in (("engine", "normal"), ("completion-engine", "completion")):
        args = build_parser().parse_args([command, "--async-scheduling"])
        assert engine_config(args, role).async_scheduling
        assert role_engine_args(["--async-scheduling"], role) == ["--async-scheduling"]
    assert not engine_config(build_parser().parse_args(["engine"]), "normal").async_scheduling
    assert role_engine_args(["--async-scheduling"], "prompt") == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prompt-engine", "--async-scheduling"])
    assert "unrecognized arguments: --async-scheduling" in capsys.readouterr().err
    with pytest.raises(ValueError, match="async_scheduling=True on a prompt engine"):
        EngineConfig(async_scheduling=True, engine_type="prompt")
