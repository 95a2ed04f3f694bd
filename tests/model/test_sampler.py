"""Sampler: validation, greedy, top-k/top-p support, seeded reproducibility, log-probs."""

from __future__ import annotations

import pytest
import torch

from baton.model.sampler import Sampler
from baton.sampling.params import SamplingParams


@pytest.mark.parametrize("kwargs, bad", [
    ({"temperature": -0.1}, "-0.1"), ({"top_p": 0.0}, "0.0"), ({"top_p": 1.5}, "1.5"),
    ({"top_k": -2}, "-2"), ({"max_tokens": 0}, "0"), ({"seed": -1}, "-1"),
    ({"stop_token_ids": (3, -4)}, "-4"), ({"sample_index": -1}, "-1"),
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


def test_seeded_draw_depends_on_seed_index_and_position_only() -> None:
    """Row 0's token at output position k is the same whatever shares its batch, whatever
    came before on its row; another position, index or seed draws anew."""
    logits = _logits(1, 50) / 3  # flat enough that draws differ
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch_rows: int, position: int, params: SamplingParams = seeded) -> int:
        others = [SamplingParams(temperature=1.0, seed=9)] * (batch_rows - 1)
        outputs = [[7] * position] + [[3] * (i + 5) for i in range(batch_rows - 1)]
        ids, _ = Sampler()(logits.repeat(batch_rows, 1), [params, *others],
                           output_token_ids=outputs)
        return int(ids[0])

    alone = [draw(1, k) for k in range(40)]
    assert alone == [draw(3, k) for k in range(40)]
    assert alone == [draw(1, k) for k in range(40)]
    assert len(set(alone)) > 5  # it does sample
    other_choice = SamplingParams(temperature=1.0, seed=1234, sample_index=1)
    assert [draw(1, k, other_choice) for k in range(40)] != alone
    other_seed = SamplingParams(temperature=1.0, seed=1235)
    assert [draw(1, k, other_seed) for k in range(40)] != alone


def test_seeded_draws_follow_the_distribution() -> None:
    """Over many positions a seeded row's tokens are distributed as the row's probabilities
    (the hash is a fair uniform): frequencies of a 5-token distribution within 2%."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]]))
    params = SamplingParams(temperature=1.0, seed=77)
    n = 20000
    ids, _ = Sampler()(logits.repeat(n, 1), [params] * n,
                       output_token_ids=[range(k) for k in range(n)])
    freq = torch.bincount(ids, minlength=5).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0]), atol=0.02), freq
    assert int(freq[4]) == 0  # a token of probability 0 is never drawn


def test_inverse_cdf_never_returns_a_masked_token() -> None:
    """Targets at both ends (u = 0, u just below 1) land on tokens of nonzero probability,
    also when the mass sits at the start or end of the vocabulary."""
    from baton.model.sampler import _inverse_cdf

    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    for u in (0.0, 1.0 - 2**-24, 1.0):
        chosen = _inverse_cdf(probs, torch.tensor([u, u])).tolist()
        assert probs[0, chosen[0]] > 0 and chosen[1] == 4, (u, chosen)


def test_a_seeded_row_without_its_outputs_is_refused() -> None:
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(_logits(1), [SamplingParams(temperature=1.0, seed=3)])


# ---------------------------------------------------------------- penalties, bias, min_tokens

@pytest.mark.parametrize("kwargs, bad", [
    ({"presence_penalty": 2.5}, "2.5"), ({"frequency_penalty": -3.0}, "-3.0"),
    ({"repetition_penalty": 0.0}, "0.0"), ({"min_p": 1.5}, "1.5"),
    ({"min_tokens": 20, "max_tokens": 10}, "20"), ({"min_tokens": -1}, "-1"),
    ({"logit_bias": {5: 101.0}}, "101"), ({"logit_bias": {-5: 1.0}}, "-5"),
    ({"presence_penalty": float("nan")}, "nan"),
])
def test_bad_new_params_name_the_value(kwargs: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        SamplingParams(**kwargs)


def _reference_process(logits: list[float], p: SamplingParams, prompt: list[int],
                       output: list[int], eos: tuple[int, ...]) -> list[float]:
    """The same formula, written out per token in plain Python."""
    out = list(logits)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if len(output) < p.min_tokens:
        for token in (*p.stop_token_ids, *(() if p.ignore_eos else eos)):
            out[token] = float("-inf")
    for token in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            x = out[token]
            out[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def test_penalties_equal_the_reference_formula() -> None:
    logits = _logits(3, 40)
    prompts = [[1, 2, 3, 3], [7, 8], [0]]
    outputs = [[3, 5, 5, 9], [8, 8, 8], []]
    params = [SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.4,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, frequency_penalty=-0.5, logit_bias={2: 3.5}),
              SamplingParams(temperature=0, repetition_penalty=0.8, min_tokens=2,
                             stop_token_ids=(4,))]
    sampler = Sampler(eos_token_ids=(6,))
    got = sampler._process(logits, params, prompts, outputs)
    for i in range(3):
        want = _reference_process(logits[i].tolist(), params[i], prompts[i], outputs[i], (6,))
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-6), i
    ids, lps = sampler(logits, params, prompt_token_ids=prompts, output_token_ids=outputs)
    assert torch.equal(ids, got.argmax(-1))
    # Log-probs stay those of the model's raw distribution.
    assert torch.allclose(lps, logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0])


def test_logit_bias_moves_the_greedy_token() -> None:
    logits = _logits(1, 50)
    top = int(logits.argmax())
    ids, _ = Sampler()(logits, [SamplingParams(temperature=0, logit_bias={top: -100.0})])
    assert int(ids[0]) != top
    ids, _ = Sampler()(logits, [SamplingParams(temperature=0, logit_bias={17: 100.0})])
    assert int(ids[0]) == 17


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0  # EOS is the greedy token
    logits[0, 4] = 4.0  # then a stop id
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,))
    sampler = Sampler(eos_token_ids=(3,))
    for output, want in (([], 0), ([9], 0), ([9, 9], 3)):
        ids, _ = sampler(logits, [params], prompt_token_ids=[[1]], output_token_ids=[output])
        assert int(ids[0]) == want, output
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    ids, _ = sampler(logits, [ignoring], output_token_ids=[[]])
    assert int(ids[0]) == 3  # EOS does not stop such a request, so it is not masked
    sampled = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=(4,))
    ids, _ = sampler(logits.repeat(64, 1), [sampled] * 64, output_token_ids=[[]] * 64)
    assert not {3, 4} & set(ids.tolist())


def test_min_p_restricts_support() -> None:
    logits = _logits(1, 50).repeat(64, 1)
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max())[:, 0].tolist())
    ids, _ = Sampler()(logits, [SamplingParams(temperature=1.0, min_p=0.3)] * 64)
    assert set(ids.tolist()) <= allowed


def test_penalties_without_token_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(_logits(1), [SamplingParams(temperature=0, presence_penalty=1.0)])


@pytest.mark.slow
def test_penalised_greedy_run_equals_transformers_with_the_reference_formula() -> None:
    """A greedy run over transformers' logits: the sampler's choice at every step equals the
    argmax of transformers' own repetition-penalty processor plus the OpenAI formula."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from .reference import baton_model, reference_model

    model, tok = reference_model(), baton_model().tokenizer
    prompt = tok.encode("List the days of the week: Monday, Tuesday,")
    eos = tuple(baton_model().config.eos_token_ids)
    params = SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.6,
                            repetition_penalty=1.4, logit_bias={tok.encode(" Wednesday")[0]: -5.0},
                            min_tokens=6, max_tokens=16, stop_token_ids=eos)
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    sampler, output, unpenalised = Sampler(eos_token_ids=eos), [], []
    for _ in range(16):
        ids = torch.tensor([prompt + output])
        with torch.inference_mode():
            logits = model(ids).logits[:, -1].float()
        unpenalised.append(int(logits.argmax()))
        want = logits.clone()
        for token, bias in params.logit_bias.items():
            want[0, token] += bias
        if len(output) < params.min_tokens:
            want[0, list(eos)] = float("-inf")
        want = repetition(ids, want)
        for token in set(output):
            want[0, token] -= params.frequency_penalty * output.count(token)
            want[0, token] -= params.presence_penalty
        got, _ = sampler(logits, [params], prompt_token_ids=[prompt], output_token_ids=[output])
        assert int(got[0]) == int(want.argmax()), (len(output), tok.decode(output))
        output.append(int(got[0]))
    assert output != unpenalised  # the penalties did change the run


def _sorted_mask(logits, top_k, top_p):
    from baton.model.sampler import _top_k_top_p_sorted

    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    return _top_k_top_p_sorted(logits, k, top_p)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.95), (0, 0.5), (50, 1.0), (50, 0.9), (5, 0.1),
                                         (1000, 0.95), (600, 0.99), (0, 1.0)])
def test_top_k_top_p_over_candidates_masks_what_the_full_sort_masks(top_k, top_p):
    # The candidate path (topk of 512, then a full sort only where needed) replaced sorting
    # every row. Its mask is the full sort's, up to float rounding of the mass before a token:
    # a token kept by one and dropped by the other has that mass within 1e-5 of top_p.
    from baton.model.sampler import _apply_top_k_top_p

    gen = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100))
    logits = torch.cat([torch.randn(16, 49152, generator=gen) * s for s in (0.1, 1.0, 4.0, 10.0)])
    k = torch.full((64,), top_k)
    p = torch.full((64,), top_p)
    new = _apply_top_k_top_p(logits, k, p)
    old = logits if (top_k == 0 and top_p == 1.0) else _sorted_mask(logits, k, p)
    kept_new, kept_old = new > float("-inf"), old > float("-inf")
    assert torch.equal(new[kept_new], logits[kept_new])  # kept logits are untouched
    for row in (kept_new != kept_old).any(dim=-1).nonzero()[:, 0].tolist():
        order = logits[row].argsort(descending=True)
        kk = top_k if 0 < top_k < 49152 else 49152
        probs = logits[row][order].masked_fill(torch.arange(49152) >= kk, float("-inf")).softmax(-1)
        mass_before = dict(zip(order.tolist(), (probs.cumsum(-1) - probs).tolist(), strict=True))
        for token in (kept_new[row] != kept_old[row]).nonzero()[:, 0].tolist():
            assert abs(mass_before[token] - top_p) < 1e-5, (row, token, mass_before[token])
