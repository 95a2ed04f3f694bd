"""Tool calls for a model whose chat template has no tool format (SmolLM2's has none): the
generic way llama.cpp's server uses. The tools are described in a system message and the
output is constrained by a JSON schema (router/structured.py's grammar path):

  tool_choice "required"  {"name": <one of the tools>, "arguments": <its parameters schema>}
  a named function        the same, for that one tool
  "auto" (the default)    {"tool_call": <a call as above>} or {"response": "<plain answer>"}
  "none"                  plain text; the tools are not shown to the model

The answer is parsed back into `message.tool_calls` (finish reason `tool_calls`) or, for an
"auto" answer, `message.content`. An assistant message of the history that carried tool_calls
is shown to the model as the JSON it would have written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from baton.engine.grammar import grammar_error
from router.openai_protocol import bad_request
from router.text import ModelInfo

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ToolPlan:
    mode: str  # "required" (also a named function) or "auto"
    grammar: str  # llguidance's, of the schema above
    system: str  # what the model is told about the tools


def plan_tools(body: Any, info: ModelInfo) -> ToolPlan | None:
    """The tool plan of a chat request (None: no tools, or tool_choice "none"); 400 if bad."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    if not tools or choice == "none":
        return None
    functions = _functions(tools)
    if choice in (None, "auto"):
        mode, chosen = "auto", functions
    elif choice == "required":
        mode, chosen = "required", functions
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise bad_request(f"'tool_choice' names {json.dumps(name)[:70]}, which is not one "
                              "of the tools", "tool_choice")
        mode = "required"
    else:
        raise bad_request("'tool_choice' must be none, auto, required or "
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    call = _call_schema(chosen)
    schema = call if mode == "required" else {"anyOf": [
        _object({"tool_call": call}), _object({"response": {"type": "string"}})]}
    # Compact JSON: a small model given free whitespace may indent until max_tokens.
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    error = grammar_error(grammar, info.tokenizer)
    if error:
        raise bad_request(f"Invalid 'tools' parameters schema: {error.strip()[:500]}", "tools")
    return ToolPlan(mode, grammar, _system_text(chosen, mode))


def _functions(tools: list) -> list[dict]:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{...}}", f"tools.{i}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not _NAME.match(name) or name in seen:
            raise bad_request(f"tools[{i}].function.name must be a unique name of 1-64 letters, "
                              "digits, _ or -", f"tools.{i}.function.name")
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools.{i}.function.parameters")
        seen.add(name)
        functions.append({"name": name, "description": str(fn.get("description", "")),
                          "parameters": params})
    return functions


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _call_schema(functions: list[dict]) -> dict:
    calls = [_object({"name": {"const": f["name"]}, "arguments": f["parameters"]})
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _system_text(functions: list[dict], mode: str) -> str:
    listed = json.dumps(functions, ensure_ascii=False)
    call = '{"name": <tool name>, "arguments": <its arguments>}'
    if mode == "required":
        ask = f"Respond with one JSON object that calls one of them: {call}."
    else:
        ask = (f'Respond with one JSON object: {{"tool_call": {call}}} to call a tool, or '
               '{"response": "<your answer>"} to answer directly.')
    return f"You can call these tools:\n{listed}\n{ask}"


def with_tools(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """The chat with the tools' description in the (first) system message."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{plan.system}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": plan.system}, *messages]


def history_text(tool_calls: list[dict]) -> str:
    """An earlier assistant turn's tool calls, as the JSON the model writes for them."""
    calls = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("An assistant message's tool_calls need function.name",
                              "messages")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise bad_request("An assistant message's tool call arguments must be JSON",
                              "messages") from None
        calls.append({"name": fn["name"], "arguments": args})
    return "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)


def parse_answer(mode: str, text: str, finish_reason: str) -> tuple[dict, str]:
    """(message fields, finish reason) of a constrained answer; a cut-off one is plain text."""
    try:
        obj = json.loads(text)
    except ValueError:
        return {"content": text}, finish_reason
    call = obj if mode == "required" else obj.get("tool_call")
    if call is None:
        return {"content": obj.get("response", "")}, finish_reason
    return {"content": None, "tool_calls": [{
        "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
        "function": {"name": call["name"],
                     "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}]}, \
        "tool_calls"
