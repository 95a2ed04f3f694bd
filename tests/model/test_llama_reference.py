"""Greedy tokens of the paged model equal transformers' on the same GGUF (fp32, CPU)."""

from __future__ import annotations

import pytest

from .reference import (
    PagedDriver,
    baton_model,
    chat_prompt,
    prompt_of_length,
    reference_greedy,
    truncate_at_eos,
)

NEW_TOKENS = 10
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver() -> PagedDriver:
    return PagedDriver(num_blocks=96)


def _expect(prompt: list[int]) -> list[int]:
    return list(reference_greedy(tuple(prompt), NEW_TOKENS))


def _check(got: list[int], prompt: list[int]) -> None:
    want = _expect(prompt)
    got = truncate_at_eos(got, baton_model().config.eos_token_ids)
    assert got[:len(want)] == want, (baton_model().tokenizer.decode(got),
                                     baton_model().tokenizer.decode(want))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_greedy_matches_reference(driver: PagedDriver, length: int) -> None:
    prompt = prompt_of_length(length)
    _check(driver.greedy([prompt], NEW_TOKENS)[0], prompt)


def test_chat_prompt_matches_reference(driver: PagedDriver) -> None:
    prompt = chat_prompt()
    _check(driver.greedy([prompt], NEW_TOKENS)[0], prompt)


def test_chunked_prefill_and_batched_decode_match(driver: PagedDriver) -> None:
    """Chunks of 16/7 tokens see their earlier chunks, also when the chunks of several prompts
    (and single-token prompts) share a step; a mixed-length decode batch is exact."""
    prompts = [prompt_of_length(n) for n in (1, 17, 300)] + [chat_prompt()]
    outs = driver.greedy(prompts * 2, NEW_TOKENS, chunk_size=[16] * 4 + [7] * 4)
    for got, prompt in zip(outs, prompts * 2, strict=True):
        _check(got, prompt)
    assert len(driver.free) == driver.num_blocks - 1
