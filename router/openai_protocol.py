"""The OpenAI request bodies the router accepts, and the error body it answers with.

Parsing is strict (no "5" for 5, no 1.5 for an int) so a wrong type is a 400 that names the
field, never a silent coercion. Fields the router does not act on (`user`, penalties, ...) are
accepted and ignored, as clients send them by default; fields it cannot honour (`n` > 1,
`logprobs`, `echo`) are refused by `check_*` with a message saying so.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class APIError(Exception):
    """An error the client gets as an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool | None = False  # vLLM's extension: generate exactly max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


def parse_body(raw: bytes, model: type[_Strict]) -> Any:
    """The request body as `model`, or APIError(400) naming the first problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def validation_error(errors: list[dict]) -> APIError:
    """One readable 400 out of pydantic's (or FastAPI's) error list."""
    if not errors:
        return bad_request("Invalid request body")
    # A union field yields one error per member; the first names the field well enough.
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Drop pydantic's union-member tags ("str", "list[int]") from the location.
    path = [p for p in loc if "[" not in p and p not in _TYPE_TAGS and not p[:1].isupper()]
    param = ".".join(path) or None
    if first.get("type") == "missing":
        return bad_request(f"Missing required field '{param}'", param=param)
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unknown field '{param}'", param=param)
    got = first.get("input")
    shown = json.dumps(got)[:80] if _is_jsonable(got) else type(got).__name__
    return bad_request(f"Invalid value for '{param}': {first.get('msg', 'invalid')} (got {shown})",
                       param=param)


def _is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
