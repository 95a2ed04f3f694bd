"""Sampler: validation, greedy, top-k/top-p support, seeded reproducibility, log-probs."""

from __future__ import annotations

import pytest
import torch

from baton.sampler import Sampler, SamplingParams


@pytest.mark.parametrize("kwargs, bad", [
    ({"temperature": -0.1}, "-0.1"), ({"top_p": 0.0}, "0.0"), ({"top_p": 1.5}, "1.5"),
    ({"top_k": -2}, "-2"), ({"max_tokens": 0}, "0"), ({"seed": -1}, "-1"),
    ({"stop_token_ids": (3, -4)}, "-4"),
])
def test_bad_params_name_the_value(kwargs: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        SamplingParams(**kwargs)


def _logits(n: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax_with_logprobs() -> None:
    logits = _logits()
    ids, lps = Sampler()(logits, [SamplingParams(temperature=0)] * 4)
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.allclose(lps, logits.log_softmax(-1).max(-1).values)


def test_top_k_and_top_p_restrict_support() -> None:
    logits = _logits(1, 50).repeat(64, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    ids, _ = Sampler()(logits, [SamplingParams(temperature=2.0, top_k=5)] * 64)
    assert set(ids.tolist()) <= top5
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[:int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    ids, _ = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=0.5)] * 64)
    assert set(ids.tolist()) <= nucleus


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = _logits(1, 50) / 3  # flat enough that draws differ
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch_rows: int) -> list[int]:
        gen = seeded.make_generator()
        params = [seeded] + [SamplingParams(temperature=1.0)] * (batch_rows - 1)
        out = []
        for _ in range(20):
            ids, _ = Sampler()(logits.repeat(batch_rows, 1), params,
                               [gen] + [None] * (batch_rows - 1))
            out.append(int(ids[0]))
        return out

    assert draw(1) == draw(3)
    assert len(set(draw(1))) > 1  # it does sample
