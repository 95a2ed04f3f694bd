"""From a parsed OpenAI body to what the engines get: prompt token ids and SamplingOptions.

Every check here is about the client's input and answers 400 (404 for an unknown model) with
the bad value in the message, before any engine is involved. It runs in a prepare worker
process (router/prepare_pool.py); the cheap checks come first, and a text so long that it must
exceed the context is refused before tokenizing: no token covers more than
`ModelInfo.max_token_chars` characters.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from baton.protocol import MAX_CACHE_SALT_CHARS, MAX_TOP_LOGPROBS, SamplingOptions
from router.openai_protocol import (
    UNSUPPORTED_WHY,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    unsupported_fields,
)
from router.structured import asks_structured, request_grammar
from router.text import ModelInfo
from router.tools import history_text, plan_tools, with_tools

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
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
    min_tokens: int = 0  # stop strings are not matched before this many tokens
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: bool = False  # answer each output token's logprob
    top_logprobs: int = 0  # ... and this many alternatives of each
    echo: bool = False  # completions: the prompt's text (and logprobs) come first
    prompt_text: str = ""  # echo: the prompt as text
    # Completions with echo and max_tokens 0: the engines make one token, the client gets none.
    drop_output: bool = False
    tool_mode: str = ""  # chat with tools: "required" or "auto" (router/tools.py)
    cache_salt: str = ""  # the tenant's prefix-cache salt ("" = the shared cache)
    api_key_name: str = ""  # the named API key it came with (router/api_keys.py)
    lora_name: str = ""  # the LoRA adapter its `model` names ("" = the base model)


def prepare_completion(body: CompletionRequest, info: ModelInfo,
                       adapters: Collection[str] = ()) -> Prepared:
    """`adapters`: the LoRA adapters the engines serve (a `model` may name one)."""
    _check_common(body, info, adapters)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}",
                          "logprobs")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(f"Only one prompt per request is supported, got {len(prompt)}",
                              "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        _check_text_length(len(prompt), "prompt", info)
        ids = info.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not ids:
            raise bad_request("'prompt' must not be empty", "prompt")
        if len(ids) >= info.max_model_len:
            raise bad_request(f"This model's maximum context length is {info.max_model_len} "
                              f"tokens, but the prompt has {len(ids)} tokens", "prompt")
        vocab = info.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise bad_request(f"Prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                              "prompt")
    # echo with max_tokens 0 scores the prompt only (lm-eval's loglikelihood requests).
    drop_output = bool(body.echo) and body.max_tokens == 0
    max_tokens = _max_tokens(1 if drop_output else body.max_tokens, "max_tokens", "prompt",
                             len(ids), info, default=COMPLETIONS_DEFAULT_MAX_TOKENS)
    prep = _prepared("completion", "cmpl", body, ids, max_tokens, info)
    prep.model = body.model
    prep.lora_name = "" if body.model == info.name else body.model
    if body.logprobs is not None:
        prep.logprobs, prep.top_logprobs = True, body.logprobs
        prep.sampling.logprobs, prep.sampling.top_logprobs = True, body.logprobs
    if body.echo:
        prep.echo, prep.drop_output = True, drop_output
        prep.prompt_text = prompt if isinstance(prompt, str) else info.tokenizer.decode(ids)
        if body.logprobs is not None:
            prep.sampling.prompt_logprobs = body.logprobs
    return prep


def prepare_chat(body: ChatCompletionRequest, info: ModelInfo,
                 adapters: Collection[str] = ()) -> Prepared:
    _check_common(body, info, adapters)
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                          "top_logprobs")
    if top and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if not body.messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    plan = plan_tools(body, info)
    if plan is not None:
        if asks_structured(body):
            raise bad_request("'tools' and a structured output cannot go together: both "
                              "constrain the answer", "tools")
        if body.ignore_eos or body.min_tokens:
            raise bad_request("'ignore_eos' and 'min_tokens' cannot go with tool calls: the "
                              "constrained answer ends with EOS", "tools")
    messages = [{"role": m.role, "content": history_text(m.tool_calls) if m.tool_calls
                 else m.text()} for m in body.messages]
    if plan is not None:
        messages = with_tools(messages, plan)
    _check_text_length(sum(len(m["content"]) for m in messages), "messages", info)
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
    prep = _prepared("chat", "chatcmpl", body, ids, max_tokens, info)
    prep.model = body.model
    prep.lora_name = "" if body.model == info.name else body.model
    if plan is not None:
        prep.sampling.grammar, prep.tool_mode = plan.grammar, plan.mode
    if body.logprobs:
        prep.logprobs, prep.top_logprobs = True, top or 0
        prep.sampling.logprobs, prep.sampling.top_logprobs = True, top or 0
    return prep


def _check_common(body: CompletionRequest | ChatCompletionRequest, info: ModelInfo,
                  adapters: Collection[str] = ()) -> None:
    if body.model != info.name and body.model not in adapters:
        served = ", ".join(f"'{m}'" for m in [info.name, *sorted(adapters)])
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                       f"{served} (GET /v1/models)", param="model", code="model_not_found")
    unsupported = unsupported_fields(body)
    if unsupported:
        why = UNSUPPORTED_WHY.get(unsupported[0])
        raise bad_request(f"'{unsupported[0]}' is not supported by this server"
                          f"{': ' + why if why else ''}; omit it", unsupported[0])
    if body.n is not None and not 1 <= body.n <= info.max_n:
        raise bad_request(f"'n' must be in [1, {info.max_n}] (this server's --max-n), got "
                          f"{body.n}", "n")
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
    _check_penalties(body)
    _check_token_ids(body, info)


def _check_text_length(num_chars: int, param: str, info: ModelInfo) -> None:
    """Refuse, without tokenizing, a text that cannot fit: each token covers at most
    max_token_chars characters, so it is at least num_chars / max_token_chars tokens."""
    if num_chars > info.max_model_len * info.max_token_chars:
        raise bad_request(f"This model's maximum context length is {info.max_model_len} tokens, "
                          f"but the {param} has {num_chars} characters, more than "
                          f"{info.max_model_len} tokens of at most {info.max_token_chars} "
                          "characters can hold", param)


def _check_range(body, name: str, low: float, high: float) -> None:
    value = getattr(body, name)
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise bad_request(f"'{name}' must be in [{low:g}, {high:g}], got {value}", name)


def _check_penalties(body: CompletionRequest | ChatCompletionRequest) -> None:
    _check_range(body, "presence_penalty", -2.0, 2.0)
    _check_range(body, "frequency_penalty", -2.0, 2.0)
    r = body.repetition_penalty
    if r is not None and not (math.isfinite(r) and r > 0):
        raise bad_request(f"'repetition_penalty' must be a finite number > 0, got {r}",
                          "repetition_penalty")
    _check_range(body, "min_p", 0.0, 1.0)
    if body.min_tokens is not None and body.min_tokens < 0:
        raise bad_request(f"'min_tokens' must be >= 0, got {body.min_tokens}", "min_tokens")


def _check_token_ids(body: CompletionRequest | ChatCompletionRequest, info: ModelInfo) -> None:
    vocab = info.tokenizer.vocab_size
    stop_ids = body.stop_token_ids or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"At most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_ids)}",
                          "stop_token_ids")
    bad = [t for t in stop_ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab})",
                          "stop_token_ids")
    for key, bias in (body.logit_bias or {}).items():
        token = int(key) if key.isdecimal() and len(key) < 12 and key.isascii() else -1
        if not 0 <= token < vocab:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab}), got "
                              f"{key[:20]!r}", "logit_bias")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias} for token "
                              f"{token}", "logit_bias")


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
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must be at most the maximum of tokens "
                          f"to generate ({max_tokens})", "min_tokens")
    eos_ids = [] if ignore_eos else list(info.stop_token_ids)
    user_stop_ids = [t for t in body.stop_token_ids or [] if t not in eos_ids]
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        # Past the vocabulary, top-k keeps every token: the same as off.
        top_k=min(max(0, body.top_k or 0), info.tokenizer.vocab_size),
        seed=body.seed,
        stop_token_ids=eos_ids + list(dict.fromkeys(user_stop_ids)),
        ignore_eos=ignore_eos,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=1.0 if body.repetition_penalty is None
        else float(body.repetition_penalty),
        logit_bias={int(k): float(v) for k, v in (body.logit_bias or {}).items()},
        min_tokens=min_tokens,
        min_p=float(body.min_p or 0.0),
        n=body.n or 1,
        speculative=body.speculative is not False,
    )
    sampling.grammar = request_grammar(body, info)
    if body.cache_salt is not None and not 0 < len(body.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most "
                          f"{MAX_CACHE_SALT_CHARS} characters, got {len(body.cache_salt)}",
                          "cache_salt")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    options = body.stream_options
    return Prepared(kind=kind, req_id=f"{prefix}-{uuid.uuid4().hex}", model=info.name,
                    prompt_token_ids=ids, sampling=sampling, stop=[s for s in stops if s],
                    cache_salt=body.cache_salt or "",
                    min_tokens=min_tokens,
                    stream=bool(body.stream),
                    include_usage=bool(body.stream and options and options.include_usage))
