"""/openapi.json that documents every body: the handlers read their JSON themselves (msgspec
first, router/openai_protocol.py), so FastAPI cannot see the request models; they are added
here as each operation's requestBody, their nested models as components."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from router import api_models
from router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)

_REF = "#/components/schemas/{model}"
REQUEST_MODELS = {"/v1/completions": CompletionRequest,
                  "/v1/chat/completions": ChatCompletionRequest,
                  "/v1/load_lora_adapter": LoadLoraAdapterRequest,
                  "/v1/unload_lora_adapter": UnloadLoraAdapterRequest}
_GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 502, 503)


def generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a generation route: the JSON body, or SSE when `stream` is true."""
    return {200: {"model": model, "content": {"text/event-stream": {
        "schema": {"type": "string", "description": "`data: <chunk JSON>` lines, then "
                   "`data: [DONE]`"}}}},
            **api_models.error_responses(*_GENERATION_ERRORS)}


def install(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_MODELS.items():
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
