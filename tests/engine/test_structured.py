"""Structured output in the engine (NORMAL mode): every token follows the grammar, each grammar
is compiled once, and a structured request that is preempted is terminated, never recomputed
(its matcher cannot be replayed), while its unstructured neighbour is recomputed exactly."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
from model.reference import baton_model, prompt_of_length

from baton.engine import LLMEngine
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _engine(**overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": 64, **overrides}), loaded=baton_model())


def test_json_schema_and_regex_outputs_follow_their_grammars() -> None:
    engine = _engine()
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "A person as JSON, please."}],
                                  tokenize=True)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=48, grammar=grammar),
              SamplingParams(temperature=1.0, seed=7, max_tokens=48, grammar=grammar),
              SamplingParams(temperature=0, max_tokens=8,
                             grammar=llguidance.LLMatcher.grammar_from_regex("(red|green)!"))]
    outs = engine.generate([ids] * 3, params)
    for out in outs[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert outs[2].text in ("red!", "green!") and outs[2].finish_reason == "stop"
    assert engine.inputs.grammars.num_compiled == 2  # the schema once for both requests
    assert engine.num_free_blocks() == engine.num_total_blocks()
    with pytest.raises(ValueError, match="invalid grammar"):
        engine.add_request("bad", ids, SamplingParams(
            grammar=llguidance.LLMatcher.grammar_from_regex("a(b")))
    assert engine.scheduler.num_waiting() == 0  # refused before the scheduler saw it


def test_preempted_structured_request_is_terminated_not_recomputed() -> None:
    engine = _engine(num_blocks=8)  # 7 blocks of 16: two sequences of 80 tokens cannot fit
    prompt = prompt_of_length(40)
    structured = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                grammar=llguidance.LLMatcher.grammar_from_regex("(ab )+"))
    for i in range(2):
        engine.add_request(f"s{i}", prompt, structured)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    # Whichever was preempted finished there; nothing was prefilled a second time.
    assert sorted(finished.values()) == ["insufficient_system_resource", "length"], finished
    assert engine.num_recomputed == 0
    assert engine.num_free_blocks() == engine.num_total_blocks()
