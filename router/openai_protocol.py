"""The OpenAI request bodies the router accepts, and the error body it answers with.

Parsing is strict (no "5" for 5, no 1.5 for an int) so a wrong type is a 400 that names the
field, never a silent coercion. JSON is decoded by msgspec, which bounds what it builds: ints
beyond 64 bits, floats beyond double range, invalid UTF-8 and nesting past the recursion limit
are all a 400 here, never a 5xx.

No silent ignore (STYLE 20): every field declared here either acts, or is bookkeeping for the
client with nothing to act on (`user`, `metadata`, `store`, `service_tier`, ...: accepted as
the OpenAI API defines them: `BOOKKEEPING`, listed in the README and logged the first time a
process sees each), or is one Baton does not implement: `UNSUPPORTED` lists those, and a request
that sets one (to anything but its no-op value) gets a 400 naming it (router/prepare.py). A field
declared nowhere (top level or in a message) is a 400 naming it, as OpenAI's API answers.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from baton.protocol import MAX_LORA_NAME_CHARS, MAX_PATH_CHARS

logger = logging.getLogger(__name__)


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

    def __reduce__(self):  # it crosses from the prepare workers (router/prepare_pool.py)
        return APIError, (self.status, self.message, self.type, self.param, self.code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # vLLM's extensions
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    # Baton's: false = no speculative decoding for this request (the engine's drafts are
    # skipped; the output is the same, only the speed may differ)
    speculative: bool | None = None
    # vLLM's: a tenant's tag; its prompt blocks hit only requests with the same salt
    # (baton/engine/block_keys.py), so no tenant learns from another's cache hits.
    cache_salt: str | None = None
    # Bookkeeping for the client; nothing to act on.
    user: str | None = None
    # Not implemented (UNSUPPORTED): requests are served in arrival order.
    priority: int | None = None
    # Structured outputs (router/structured.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: Any = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an earlier answer's (router/tools.py)
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Bookkeeping for the client; nothing to act on.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Tool calls (router/tools.py); at most one call per answer, which parallel_tool_calls
    # either way allows.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Not implemented: a 400 unless unset or its no-op value (UNSUPPORTED).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


# Field -> the values that ask for nothing (besides null): any other value is a 400.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",), "priority": (0,),
    "functions": ([],), "function_call": ("none",), "modalities": (["text"],), "audio": (),
    "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": (),
}


# Why a field is UNSUPPORTED, where more than "not implemented" is worth saying.
UNSUPPORTED_WHY = {
    "priority": "requests are served in arrival order (docs/scheduler.md, S15 and S26)",
}
# Accepted as OpenAI defines them, with nothing to act on (README: "Request fields").
BOOKKEEPING = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
               "safety_identifier")
_bookkeeping_seen: set[str] = set()


def unsupported_fields(body: BaseModel) -> list[str]:
    """The UNSUPPORTED fields `body` sets to something that would need acting on."""
    found = []
    for name, no_ops in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and value not in no_ops:
            found.append(name)
    return found


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes, model: type[_Strict]) -> Any:
    """The request body as `model`, or APIError(400) naming the first problem."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("Request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(f"Request body must be a JSON object, got {_json_type(data)}")
    # A lone surrogate (an escape JSON allows) is no character: it cannot be tokenized or sent.
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise bad_request("Request body holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF "
                          "without its pair): not a character")
    _log_bookkeeping(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise bad_request("Request body is nested too deeply") from None


def _log_bookkeeping(data: dict) -> None:
    """Say once per process which bookkeeping fields arrive (accepted, nothing done)."""
    for name in BOOKKEEPING:
        if data.get(name) is not None and name not in _bookkeeping_seen:
            _bookkeeping_seen.add(name)
            logger.info("request field %r accepted without effect (bookkeeping for the "
                        "client; logged once)", name)


def _json_type(value: Any) -> str:
    names = {str: "string", int: "number", float: "number", bool: "boolean", list: "array"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _has_lone_surrogate(data: Any) -> bool:
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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
    shown = _shown(got)
    return bad_request(f"Invalid value for '{param}': {first.get('msg', 'invalid')} (got {shown})",
                       param=param)


def _shown(value: Any) -> str:
    """At most 80 characters of the offending value, without serialising all of a huge one."""
    if isinstance(value, list) and len(value) > 8:
        return f"an array of {len(value)} items"
    if isinstance(value, dict) and len(value) > 8:
        return f"an object of {len(value)} keys"
    if isinstance(value, str) and len(value) > 80:
        value = value[:80]
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError, RecursionError):
        return type(value).__name__


class LoadLoraAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter body: a PEFT folder every engine can read."""

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
