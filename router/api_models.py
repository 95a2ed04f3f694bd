"""Response bodies as pydantic models, so /openapi.json documents every body the router sends
(the requests are router/openai_protocol.py's). They describe; the handlers build plain dicts
(router/serving.py), and the schemathesis test (tests/router/test_openapi.py) checks that
every answer matches its model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Open):
    error: ErrorDetail


class PromptTokensDetails(_Open):
    cached_tokens: int


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Open):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    # A LoRA adapter's card (vLLM's): the model it adapts, and the adapter itself.
    parent: str | None = None
    root: str | None = None


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Open):
    status: str
    engines: dict[str, int]
    reason: str | None = None


class Observations(_Open):
    now: float  # the router's wall clock (seconds since the epoch)
    observations: list[list[float]]  # [arrival time, prompt tokens, output tokens] each
    # [end time, TTFT s, TPOT s, 1 finished / 0 failed or refused] of each request that ended
    outcomes: list[list[float]] = []


class Plan(_Open):
    status: str  # "none": no planner publishes; else its last decision's action
    plan: dict[str, Any] | None = None


class LoraResult(_Open):
    status: str
    lora_name: str
    engines: dict[str, bool]


class ResetResult(_Open):
    status: str
    engines: dict[str, bool]
    reason: str | None = None


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries: each status answers an ErrorResponse."""
    return {status: {"model": ErrorResponse} for status in statuses}
