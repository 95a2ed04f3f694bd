"""The router's FastAPI app: OpenAI endpoints, health, metrics, auth and error bodies.

Life of one request:
1. auth middleware (when an API key is set) answers 401 to a wrong or missing key;
2. router/limits.py bounds what is read: 429 past the requests in flight, 413 past the body
   size, 408 past the body time;
3. the handler hands the raw body to a worker process (router/prepare_pool.py), which parses it (malformed JSON, wrong
   types, too deep, out-of-range numbers -> 400 naming the field), checks values and the model
   name, renders the chat template and tokenizes (router/prepare.py): none of that runs on the
   event loop, so a heavy body does not stall the other streams;
4. router/serving.py runs it through the engines (router/dispatch.py) and builds the response.
Every error leaves as an OpenAI error body; FastAPI's 422 is turned into a 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.ops.registry import Registry
from baton.protocol import ROLES
from router import api_models, lora_admin, openapi_doc
from router.api_keys import ApiKeys, per_key_salt
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.engine_pool import EnginePool, NoEngineError
from router.limits import LIMITED_PATHS, RequestLimits
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.openai_protocol import (
    APIError,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    parse_body,
    validation_error,
)
from router.prepare import Prepared
from router.prepare_pool import PreparePool
from router.serving import Server
from router.text import ModelInfo, load_model_info

logger = logging.getLogger(__name__)

_COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
_ADMIN_PATHS = ("/reset_prefix_cache", "/planner/observations")  # need the API key too, when one is set


async def _read_plan(app) -> dict | None:
    """The planner's decision from the registry; sets the recommended-engines gauge."""
    registry = app.state.pool.membership.registry
    try:
        plan = await asyncio.to_thread(registry.read_plan)
    except Exception as exc:  # a registry outage costs the plan only
        logger.warning("cannot read the planner's decision: %s", exc)
        return None
    if plan:
        for role, count in (plan.get("recommended") or {}).items():
            if role in ROLES and isinstance(count, int):
                app.state.metrics.planner_recommended.labels(role).set(count)
    return plan


def create_app(config: RouterConfig, info: ModelInfo | None = None,
               registry: Registry | None = None) -> FastAPI:
    """The router app; `info` (tokenizer, limits) and `registry` default to the config's."""
    metrics = RouterMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if info is None:
            model = await asyncio.to_thread(
                load_model_info, config.model_path, config.model_name, config.max_model_len,
                config.load_cache_dir)
            model.max_n = config.max_n
        else:  # a tokenizer loaded once (tests, embedding) still obeys this config's limits
            model = dataclasses.replace(info, name=config.model_name or info.name,
                                        max_model_len=config.max_model_len or info.max_model_len,
                                        max_n=config.max_n)
        pool = EnginePool(config, metrics, registry)
        await pool.start()
        dispatcher = Dispatcher(pool, metrics, config.first_token_timeout_s,
                                config.token_timeout_s, config.prompt_retry_limit,
                                config.migration_limit)
        app.state.model = model
        app.state.pool = pool
        app.state.prepare_pool = PreparePool(model, config.num_prepare_workers)
        await app.state.prepare_pool.start()
        app.state.server = Server(dispatcher, model, metrics)
        logger.info("router ready: model %s, engines %s", model.name,
                    {role: len(pool.records(role)) for role in ROLES})
        try:
            yield
        finally:
            await dispatcher.drain_aborts()
            await pool.close()
            app.state.prepare_pool.close()

    app = FastAPI(title="Baton router", lifespan=lifespan)
    app.state.config = config
    app.state.metrics = metrics
    app.state.started = int(time.time())
    _add_middleware(app, config, metrics)
    _add_error_handlers(app)
    _add_routes(app)
    openapi_doc.install(app)
    return app


def _add_middleware(app: FastAPI, config: RouterConfig, metrics: RouterMetrics) -> None:
    # Plain ASGI rather than @app.middleware: BaseHTTPMiddleware re-wraps streaming bodies and
    # would stand between a departing client and the cancellation of its stream. The last
    # added runs first: auth and counting see every answer, the limits' 413/429 included.
    app.add_middleware(RequestLimits, max_request_bytes=config.max_request_bytes,
                       max_concurrent_requests=config.max_concurrent_requests,
                       body_timeout_s=config.body_timeout_s)
    app.add_middleware(_AuthAndCount, api_keys=ApiKeys(config.api_keys) if config.api_keys
                       else None, metrics=metrics)


class _AuthAndCount:
    def __init__(self, app, api_keys: ApiKeys | None, metrics: RouterMetrics):
        self.app = app
        self.api_keys = api_keys
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        key_name = ""
        if self.api_keys is not None and (path.startswith("/v1/") or path in _ADMIN_PATHS):
            key = self.api_keys.identify(dict(scope["headers"]).get(b"authorization", b""))
            if key is None:
                self.metrics.requests.labels(_endpoint(path), "401").inc()
                response = _error(APIError(401, "Invalid or missing API key: send "
                                           "'Authorization: Bearer <key>'",
                                           code="invalid_api_key"))
                return await response(scope, receive, send)
            key_name = scope.setdefault("state", {})["api_key_name"] = key.name
            wait_s = self.api_keys.take(key.name) if path in LIMITED_PATHS else 0
            if wait_s:
                self.metrics.requests.labels(_endpoint(path), "429").inc()
                self.metrics.api_key_requests.labels(key.name, "429").inc()
                response = _error(APIError(
                    429, f"Rate limit of API key {key.name!r} reached; retry after {wait_s} s",
                    "rate_limit_error", code="rate_limit_exceeded"))
                response.headers["Retry-After"] = str(wait_s)
                return await response(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status = str(message["status"])
                self.metrics.requests.labels(_endpoint(path), status).inc()
                if key_name:
                    self.metrics.api_key_requests.labels(key_name, status).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _endpoint(path: str) -> str:
    return path if path in _COUNTED_PATHS else "other"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _error(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, f"{exc.detail}: {request.method} "
                               f"{request.url.path}", kind))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return _error(APIError(500, f"Internal error: {type(exc).__name__}", "internal_error"))


def _error(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    headers = {**(headers or {}), **getattr(exc, "headers", {})} or None  # Retry-After
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _off_loop(request: Request, kind: str) -> Prepared:
    """Parse, validate and tokenize the body in a prepare worker (APIError -> 4xx)."""
    raw = await request.body()  # already read, and bounded, by RequestLimits
    adapters = tuple(request.app.state.pool.lora_adapters())  # a `model` may name one
    prep = await request.app.state.prepare_pool.prepare(raw, kind, adapters)
    prep.api_key_name = request.scope.get("state", {}).get("api_key_name", "")
    if prep.api_key_name and request.app.state.config.cache_salt_per_key:
        prep.cache_salt = per_key_salt(prep.api_key_name, prep.cache_salt)
    return prep


def _add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions",
              responses=openapi_doc.generation_responses(api_models.CompletionResponse))
    async def completions(request: Request):
        arrival = time.monotonic()
        prep = await _off_loop(request, "completion")
        return await request.app.state.server.respond(prep, request, arrival)

    @app.post("/v1/chat/completions",
              responses=openapi_doc.generation_responses(api_models.ChatCompletionResponse))
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        prep = await _off_loop(request, "chat")
        return await request.app.state.server.respond(prep, request, arrival)

    @app.get("/v1/models", response_model=api_models.ModelList,
             responses=api_models.error_responses(401))
    async def models(request: Request):
        """The base model, then each LoRA adapter a live engine serves (its parent: the base)."""
        model, created = request.app.state.model, request.app.state.started
        cards = [{"id": model.name, "object": "model", "created": created, "owned_by": "baton",
                  "max_model_len": model.max_model_len, "root": model.name}]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "baton",
                   "max_model_len": model.max_model_len, "root": name, "parent": model.name}
                  for name in sorted(request.app.state.pool.lora_adapters())
                  if name != model.name]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter", response_model=api_models.LoraResult,
              responses=api_models.error_responses(400, 401, 503))
    async def load_lora_adapter(request: Request):
        """vLLM's endpoint: every live engine loads the PEFT LoRA adapter at `lora_path`
        under `lora_name`, or none does (router/lora_admin.py)."""
        body = parse_body(await request.body(), LoadLoraAdapterRequest)
        return await lora_admin.load_adapter(request.app.state.pool,
                                             request.app.state.model.name, body)

    @app.post("/v1/unload_lora_adapter", response_model=api_models.LoraResult,
              responses=api_models.error_responses(400, 401, 404, 503))
    async def unload_lora_adapter(request: Request):
        """vLLM's endpoint: every live engine serving `lora_name` unloads it."""
        body = parse_body(await request.body(), UnloadLoraAdapterRequest)
        return await lora_admin.unload_adapter(request.app.state.pool, body)

    @app.get("/health", response_model=api_models.Health,
             responses={503: {"model": api_models.Health}})
    async def health(request: Request):
        pool: EnginePool = request.app.state.pool
        engines = {role: len(pool.records(role)) for role in ROLES}
        try:
            request.app.state.server.dispatcher.check_available()
        except NoEngineError as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc), "engines": engines},
                                status_code=503)
        return {"status": "ok", "engines": engines}

    @app.post("/reset_prefix_cache", response_model=api_models.ResetResult,
              responses={**api_models.error_responses(400, 401),
                         503: {"model": api_models.ResetResult}})
    async def reset_prefix_cache(request: Request, pool_only: bool = False,
                                 shared: bool = False):
        """vLLM's endpoint: every live engine forgets its cached-free KV blocks (benchmarks
        call it between runs), and the blocks of its disk tier unless `?pool_only=true`; the
        shared tier's (every engine's, P11) only with `?shared=true`. 503 naming the engines
        that refused or did not answer; 400 for both options at once."""
        if pool_only and shared:
            raise APIError(400, "pool_only=true and shared=true contradict each other",
                           "invalid_request_error", "shared")
        pool: EnginePool = request.app.state.pool
        engines = pool.live_engines()
        replies = await asyncio.gather(*(client.reset_prefix_cache(5.0, pool_only, shared)
                                         for _, client in engines), return_exceptions=True)
        results, failed = {}, []
        for (record, _), reply in zip(engines, replies, strict=True):
            ok = not isinstance(reply, BaseException) and reply.ok
            results[record.engine_id] = ok
            if not ok:
                failed.append(f"{record.engine_id}: " + (
                    "no answer" if isinstance(reply, BaseException) else reply.message))
        if failed:
            return JSONResponse({"status": "incomplete", "engines": results,
                                 "reason": "; ".join(failed)}, status_code=503)
        return {"status": "ok", "engines": results}

    @app.get("/planner/observations", response_model=api_models.Observations,
             responses=api_models.error_responses(400, 401))
    async def planner_observations(request: Request, window_s: float = 120.0):
        """What the planner plans on: each request finished within the last `window_s`
        seconds (at most an hour): arrival time, prompt tokens, output tokens; and the outcome
        of each request that ended within it, failed and refused ones too: end time, TTFT and
        TPOT in seconds, 1 if it finished else 0. No content."""
        if not 0 < window_s <= 3600:
            raise APIError(400, "window_s must be in (0, 3600]", "invalid_request_error",
                           param="window_s")
        now = time.time()
        metrics = request.app.state.metrics
        return {"now": now,
                "observations": [list(o) for o in metrics.recent if o[0] >= now - window_s],
                "outcomes": [[t, ttft, tpot, int(ok)] for t, ttft, tpot, ok in metrics.outcomes
                             if t >= now - window_s]}

    @app.get("/planner", response_model=api_models.Plan)
    async def planner(request: Request):
        """The planner's last decision (`baton up --planner advise|apply`), from the registry."""
        plan = await _read_plan(request.app)
        return {"status": plan.get("action", "unknown") if plan else "none", "plan": plan}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics(request: Request):
        await _read_plan(request.app)  # the planner gauge is as fresh as a scrape
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
