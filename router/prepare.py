"""From a parsed OpenAI body to what the engines get: prompt token ids and SamplingOptions.

Every check here is about the client's input and answers 400 (404 for an unknown model) with
the bad value in the message, before any engine is involved.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from baton.protocol import SamplingOptions
from router.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
)
from router.text import ModelInfo

MAX_STOP_STRINGS = 16
_SEED_LIMIT = 2**63  # the wire carries a signed 64-bit integer
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy endpoint's documented default


@dataclass
class Prepared:
    """One validated request, ready for the engines."""

    kind: str  # "chat" or "completion"
    req_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def prepare_completion(body: CompletionRequest, info: ModelInfo) -> Prepared:
    _check_common(body, info)
    if body.logprobs is not None:
        raise bad_request("'logprobs' is not supported by this server; omit it", "logprobs")
    if body.echo:
        raise bad_request("'echo' is not supported by this server; omit it", "echo")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(f"Only one prompt per request is supported, got {len(prompt)}",
                              "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        ids = info.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not ids:
            raise bad_request("'prompt' must not be empty", "prompt")
        vocab = info.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise bad_request(f"Prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                              "prompt")
    max_tokens = _max_tokens(body.max_tokens, "max_tokens", "prompt", len(ids), info,
                             default=COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _prepared("completion", "cmpl", body, ids, max_tokens, info)


def prepare_chat(body: ChatCompletionRequest, info: ModelInfo) -> Prepared:
    _check_common(body, info)
    if body.logprobs or body.top_logprobs:
        raise bad_request("'logprobs' and 'top_logprobs' are not supported by this server; "
                          "omit them", "logprobs")
    if not body.messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = info.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
    except ValueError as exc:  # the template's own raise_exception, or no template at all
        raise bad_request(f"Cannot render these messages: {exc}", "messages") from None
    if body.max_completion_tokens is not None:
        max_tokens = _max_tokens(body.max_completion_tokens, "max_completion_tokens",
                                 "messages", len(ids), info)
    else:
        max_tokens = _max_tokens(body.max_tokens, "max_tokens", "messages", len(ids), info)
    return _prepared("chat", "chatcmpl", body, ids, max_tokens, info)


def _check_common(body: CompletionRequest | ChatCompletionRequest, info: ModelInfo) -> None:
    if body.model != info.name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                       f"'{info.name}'", param="model", code="model_not_found")
    if body.n is not None and body.n != 1:
        raise bad_request(f"'n' must be 1 (one choice per request is supported), got {body.n}",
                          "n")
    t = body.temperature
    if t is not None and (not math.isfinite(t) or t < 0):
        raise bad_request(f"'temperature' must be >= 0, got {t}", "temperature")
    p = body.top_p
    if p is not None and (not math.isfinite(p) or not 0 < p <= 1):
        raise bad_request(f"'top_p' must be in (0, 1], got {p}", "top_p")
    if body.top_k is not None and body.top_k < -1:
        raise bad_request(f"'top_k' must be -1 or 0 (off) or a positive count, got {body.top_k}",
                          "top_k")
    if body.seed is not None and not -_SEED_LIMIT <= body.seed < _SEED_LIMIT:
        raise bad_request(f"'seed' must fit in 64 signed bits, got {body.seed}", "seed")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"At most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")


def _max_tokens(value: int | None, param: str, prompt_param: str, num_prompt: int,
                info: ModelInfo, default: int | None = None) -> int:
    limit = info.max_model_len
    if value is not None and value < 1:
        raise bad_request(f"'{param}' must be at least 1, got {value}", param)
    if num_prompt >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the "
                          f"prompt has {num_prompt} tokens", prompt_param)
    if value is None:
        return min(default, limit - num_prompt) if default is not None else limit - num_prompt
    if num_prompt + value > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but "
                          f"{num_prompt} prompt tokens plus {param}={value} make "
                          f"{num_prompt + value}; reduce the prompt or {param}", param)
    return value


def _prepared(kind: str, prefix: str, body: CompletionRequest | ChatCompletionRequest,
              ids: list[int], max_tokens: int, info: ModelInfo) -> Prepared:
    ignore_eos = bool(body.ignore_eos)
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop_token_ids=[] if ignore_eos else list(info.stop_token_ids),
        ignore_eos=ignore_eos,
    )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    options = body.stream_options
    return Prepared(kind=kind, req_id=f"{prefix}-{uuid.uuid4().hex}", model=info.name,
                    prompt_token_ids=ids, sampling=sampling, stop=[s for s in stops if s],
                    stream=bool(body.stream),
                    include_usage=bool(body.stream and options and options.include_usage))
