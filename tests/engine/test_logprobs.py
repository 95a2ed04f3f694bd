"""Logprobs in the engine against transformers on the same weights: each sampled token's
logprob and its top alternatives, and a prompt's token logprobs (echo), computed while
prefilling, in chunks or not, and never from the prefix cache (a cached prefix has no logits)."""

from __future__ import annotations

import pytest
import torch
from model.reference import baton_model, prompt_of_length, reference_model

from baton.engine import LLMEngine, RequestOutput
from baton.sampling.params import SamplingParams
from tests.threads import engine_config

pytestmark = pytest.mark.slow
TOL = 1e-4


def _engine(**overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": 64, **overrides}), loaded=baton_model())


def _run(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("r", ids, params)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    assert engine.num_free_blocks() == engine.num_total_blocks()
    return outputs


def _reference_logprobs(ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `ids`: [len, vocab]."""
    with torch.inference_mode():
        logits = reference_model()(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunked"])
def test_prompt_and_output_logprobs_equal_transformers(chunk: int) -> None:
    prompt = prompt_of_length(45)
    engine = _engine(max_num_batched_tokens=chunk)
    engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2))  # fill the cache
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=True,
                            top_logprobs=5, prompt_logprobs=3)
    outputs = _run(engine, prompt, params)
    first = outputs[0]
    assert first.num_cached_tokens == 0  # the cached prefix was computed again
    assert first.prompt is not None and len(first.prompt.logprobs) == len(prompt) - 1
    tokens = [t for o in outputs for t in o.new_token_ids]
    ref = _reference_logprobs(prompt + tokens)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(first.prompt.logprobs), want, atol=TOL)
    top_values, top_ids = ref[:len(prompt) - 1].topk(3, dim=-1)
    assert first.prompt.top_token_ids == top_ids.tolist()
    assert torch.allclose(torch.tensor(first.prompt.top_logprobs), top_values, atol=TOL)
    for i, out in enumerate(outputs):
        row = ref[len(prompt) - 1 + i]
        token, logprob = out.new_token_ids[0], out.new_logprobs[0]
        assert out.top.token_ids[0][0] == token  # greedy: the chosen is the most likely
        assert out.top.logprobs[0][0] == logprob
        assert out.top.token_ids[0] == row.topk(5).indices.tolist()
        assert abs(logprob - float(row[token])) < TOL


def test_prompt_logprobs_survive_a_recompute() -> None:
    """Preempted after its prompt was scored: the recompute does not score it twice."""
    engine = _engine(num_blocks=8, max_num_seqs=4)
    prompt = prompt_of_length(40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True,
                            prompt_logprobs=0)
    for i in range(2):  # two sequences of 80 tokens (5 blocks) cannot fit 7 blocks of 16
        engine.add_request(f"r{i}", prompt, params)
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt is not None and out.request_id not in firsts:
                firsts[out.request_id] = out.prompt
    assert engine.num_recomputed > 0
    want = _reference_logprobs(prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    for scored in firsts.values():
        assert len(scored.logprobs) == len(prompt) - 1
        assert torch.allclose(torch.tensor(scored.logprobs), want, atol=TOL)
    assert engine.num_free_blocks() == engine.num_total_blocks()
