"""Structured outputs: the request's grammar, in llguidance's form, checked before dispatch.

Accepted spellings, one per request:
  response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema":
                   {"name", "schema", "strict"}} (OpenAI) | {"type": "text"} (none)
  structured_outputs {"json": schema} | {"regex": str} | {"choice": [str]} | {"grammar": lark}
                   | {"json_object": true} (vLLM's extra), and its older top-level spellings
                   guided_json / guided_regex / guided_choice / guided_grammar.
The schema is followed as given, `strict` or not (constraining never breaks a non-strict
promise). A grammar llguidance refuses (an unknown type, a bad regex...) is a 400 carrying its
message; so is a combination that could never end (ignore_eos, min_tokens past the grammar).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from baton.engine.grammar import grammar_error
from router.openai_protocol import bad_request
from router.text import ModelInfo

_MAX_CHOICES = 256


def request_grammar(body: Any, info: ModelInfo) -> str:
    """The llguidance grammar `body` asks for ("" = unconstrained); APIError(400) if bad."""
    asked = _asked(body)
    if not asked:
        return ""
    if len(asked) > 1:
        names = ", ".join(param for param, _, _ in asked)
        raise bad_request(f"Ask for one structured output at a time, got {names}", asked[1][0])
    param, kind, value = asked[0]
    grammar = _grammar(param, kind, value)
    error = grammar_error(grammar, info.tokenizer)
    if error:
        raise bad_request(f"Invalid '{param}': {error.strip()[:500]}", param)
    if body.ignore_eos:
        raise bad_request("'ignore_eos' cannot go with a structured output: the grammar ends "
                          "with EOS", "ignore_eos")
    if body.min_tokens:
        raise bad_request("'min_tokens' cannot go with a structured output: EOS may be the "
                          "only token the grammar allows", "min_tokens")
    return grammar


def asks_structured(body: Any) -> bool:
    return bool(_asked(body))


def _asked(body: Any) -> list[tuple[str, str, Any]]:
    """(param, kind, value) of each structured output the request asks for."""
    asked = []
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("response_format", "json", {"type": "object"}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("'response_format.json_schema' must be an object with a "
                                  "'schema' object", "response_format")
            asked.append(("response_format", "json", spec.get("schema") or {}))
        elif kind != "text":
            raise bad_request("'response_format.type' must be text, json_object or "
                              f"json_schema, got {json.dumps(kind)[:40]}", "response_format")
    extra = body.structured_outputs or {}
    for kind in ("json", "regex", "choice", "grammar", "json_object"):
        if extra.get(kind) not in (None, False):
            asked.append((f"structured_outputs.{kind}", kind, extra[kind]))
    unknown = sorted(set(extra) - {"json", "regex", "choice", "grammar", "json_object"})
    if unknown:
        raise bad_request(f"Unknown 'structured_outputs' key '{unknown[0]}'",
                          "structured_outputs")
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}", None)
        if value is not None:
            asked.append((f"guided_{kind}", kind, value))
    return asked


def _grammar(param: str, kind: str, value: Any) -> str:
    if kind == "json_object":
        kind, value = "json", {"type": "object"}
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"'{param}' is not valid JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value)
        except ValueError as exc:
            raise bad_request(f"Invalid '{param}': {exc}", param) from None
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{param}' must be a non-empty regular expression", param)
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > _MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}' must be 1 to {_MAX_CHOICES} non-empty strings", param)
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, value)))
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty Lark grammar", param)
    return llguidance.LLMatcher.grammar_from_lark(value)
