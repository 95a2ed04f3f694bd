"""The router's one object per request (router/request.py) on plain data: attempts and their
wire ids, which choices are still open on the engines, and when the client has its answer."""

from __future__ import annotations

import pytest

from baton.protocol import SamplingOptions
from router.request import RouterChoice, RouterRequest
from router.text import TextStream


def _request(model_info, n: int) -> RouterRequest:
    choices = [RouterChoice(i, TextStream(model_info.tokenizer)) for i in range(n)]
    return RouterRequest("cmpl-1", [1, 2, 3], SamplingOptions(n=n), 0.0, choices)


def test_attempts_take_fresh_wire_ids_and_start_from_the_tokens_sent(model_info) -> None:
    request = _request(model_info, 1)
    first = request.start_attempt()
    assert (first.wire_id, first.output_token_ids, first.is_migration) == ("cmpl-1", [], False)
    assert not request.has_output and request.num_migrations == 0
    request.choices[0].token_ids.extend([7, 8])
    second = request.start_attempt()
    assert (second.wire_id, second.output_token_ids, second.is_migration) == \
        ("cmpl-1~m1", [7, 8], True)
    request.choices[0].token_ids.append(9)  # streamed later: not what the attempt started from
    assert second.output_token_ids == [7, 8]
    assert request.start_attempt().wire_id == "cmpl-1~m2" and request.num_migrations == 2


def test_a_request_with_several_choices_starts_again_whole_only_before_any_token(
        model_info) -> None:
    """Before any token went out it may start again whole (a mixed fleet's other path)."""
    request = _request(model_info, 2)
    request.start_attempt()
    again = request.start_attempt()
    assert (again.wire_id, again.output_token_ids) == (f"{request.req_id}~m1", [])
    request.choices[1].token_ids.append(7)
    with pytest.raises(AssertionError, match="choice by choice"):
        request.start_attempt()


def test_a_request_with_several_choices_migrates_each_as_its_own(model_info) -> None:
    request = _request(model_info, 2)
    request.start_attempt()
    request.choices[0].token_ids.append(4)
    with pytest.raises(AssertionError, match="choice by choice"):
        request.start_attempt()
    request.choices[1].token_ids.extend([5, 6])
    sub = request.for_choice(1)
    assert (sub.sampling.n, sub.sampling.sample_index) == (1, 1)
    attempt = sub.start_attempt()
    assert (attempt.wire_id, attempt.output_token_ids) == (f"{request.req_id}~c1~m1", [5, 6])
    assert sub.num_migrations == 1


def test_open_choices_are_the_ones_the_engines_still_generate(model_info) -> None:
    request = _request(model_info, 3)
    assert request.open_choices() == [0, 1, 2]
    request.choices[1].is_engine_finished = True
    assert request.open_choices() == [0, 2]
    assert [request.is_open(i) for i in (-1, 0, 1, 2, 3)] == [False, True, False, True, False]


def test_the_answer_is_done_when_every_choice_has_the_clients_finish_reason(model_info) -> None:
    request = _request(model_info, 2)
    request.choices[0].finish_reason = "stop"  # a stop string: the engine still generates it
    assert not request.is_answered and request.open_choices() == [0, 1]
    request.choices[1].finish_reason = "length"
    assert request.is_answered
    request.choices[0].num_generated, request.choices[1].num_generated = 3, 5
    assert request.num_generated() == 8


def test_choices_must_be_the_n_indices_in_order(model_info) -> None:
    with pytest.raises(AssertionError, match="n=2"):
        RouterRequest("x", [1], SamplingOptions(n=2), 0.0,
                      [RouterChoice(1, TextStream(model_info.tokenizer))])
