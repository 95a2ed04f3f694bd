"""Turn a prepared request's token deltas into OpenAI responses: one JSON body, or SSE chunks.

The first delta is awaited before any response is started, so a request no engine can take is
still a proper 503 rather than a stream that breaks. Leaving the delta loop early (stop string,
client gone) closes the dispatcher's generator, which aborts the request in the engines.
The request's state is one RouterRequest (router/request.py): the dispatcher puts each delta's
tokens on its choice, this module its text, logprobs and the finish reason the client is told.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from baton.protocol import TokenDelta
from router.admission import Overloaded
from router.dispatch import Dispatcher, EngineFailure
from router.engine_pool import NoEngineError
from router.logprobs import CompletionLogprobs, TokenText, chat_content
from router.metrics import Outcome, RouterMetrics
from router.openai_protocol import APIError
from router.prepare import Prepared
from router.request import RouterChoice, RouterRequest
from router.text import ModelInfo, TextStream
from router.tools import parse_answer

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.2


class Server:
    """Runs prepared requests through the dispatcher."""

    def __init__(self, dispatcher: Dispatcher, info: ModelInfo, metrics: RouterMetrics):
        self.dispatcher = dispatcher
        self.info = info
        self.metrics = metrics
        self.token_text = TokenText(info.tokenizer)

    async def respond(self, prep: Prepared, request: Request, arrival: float):
        state = self._new_request(prep, arrival)
        deltas = self.dispatcher.generate(state)
        first: TokenDelta | None = None
        try:
            first = await _unless_gone(request, deltas.__anext__())
            state.first_token_at = time.monotonic()
        except NoEngineError as exc:
            self._observe_failed(state)
            raise APIError(503, f"No engine available: {exc}", "service_unavailable",
                           code="no_engine") from None
        except EngineFailure as exc:
            self._observe_failed(state)
            raise APIError(503, f"Engine failure: {exc}", "service_unavailable",
                           code="engine_failure") from None
        except Overloaded:  # refused by SLO-aware admission: it missed its SLO too
            self._observe_failed(state)
            raise
        except _ClientGone:
            self.metrics.aborts.labels("client_gone").inc()
            return JSONResponse({"error": "client disconnected"}, status_code=499)
        finally:
            if first is None:  # closing runs the generator's `finally`: engines abort
                await deltas.aclose()
        if prep.stream:
            body = self._stream(prep, state, first, deltas)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await _unless_gone(request, self._collect(prep, state, first, deltas))
        except _ClientGone:
            self.metrics.aborts.labels("client_gone").inc()
            return JSONResponse({"error": "client disconnected"}, status_code=499)

    def _new_request(self, prep: Prepared, arrival: float) -> RouterRequest:
        """The request's router-side state: each choice with its text stream and, when asked,
        its completions-shaped logprobs."""
        choices = []
        for index in range(prep.sampling.n):
            choice = RouterChoice(index, TextStream(self.info.tokenizer, prep.stop,
                                                    prep.min_tokens))
            if prep.kind == "completion" and prep.logprobs:
                choice.completion_logprobs = CompletionLogprobs(self.token_text)
            choices.append(choice)
        return RouterRequest(prep.req_id, prep.prompt_token_ids, prep.sampling, arrival, choices,
                             cache_salt=prep.cache_salt, api_key_name=prep.api_key_name,
                             lora_name=prep.lora_name)

    def _start(self, prep: Prepared, state: RouterRequest, first: TokenDelta) -> None:
        """The echoed prompt (and its logprobs) into each choice: the prompt was scored once,
        on the request's first delta."""
        for choice in state.choices:
            if prep.echo:
                choice.text.text = prep.prompt_text
                if prep.logprobs:
                    self._echo_logprobs(prep, first, choice.completion_logprobs)
        state.num_cached_tokens = first.num_cached_tokens

    def _echo_logprobs(self, prep: Prepared, first: TokenDelta,
                       logprobs: CompletionLogprobs) -> None:
        ids = prep.prompt_token_ids
        num = len(ids) - 1
        # From a socket: the lists must be the prompt's, one per token after the first.
        if not (len(first.prompt_logprobs) == num
                and len(first.prompt_top_token_ids) in (0, num)
                and len(first.prompt_top_logprobs) == len(first.prompt_top_token_ids)):
            raise EngineFailure(f"engine sent {len(first.prompt_logprobs)} prompt logprobs for "
                                f"a prompt of {len(ids)} tokens", started=False)
        logprobs.add_null(ids[0])
        logprobs.add(ids[1:], first.prompt_logprobs, first.prompt_top_token_ids,
                     first.prompt_top_logprobs)

    def _add_logprobs(self, prep: Prepared, delta: TokenDelta, choice: RouterChoice) -> None:
        if not prep.logprobs or not delta.token_ids:
            return
        n = len(delta.token_ids)
        if len(delta.logprobs) != n or len(delta.top_token_ids) not in (0, n) \
                or len(delta.top_logprobs) != len(delta.top_token_ids):
            raise EngineFailure(f"engine sent {len(delta.logprobs)} logprobs for {n} tokens",
                                started=True)
        if choice.completion_logprobs is not None:
            choice.completion_logprobs.add(delta.token_ids, delta.logprobs,
                                           delta.top_token_ids, delta.top_logprobs)
        else:
            choice.chat_logprobs.extend(chat_content(
                self.token_text, delta.token_ids, delta.logprobs, delta.top_token_ids,
                delta.top_logprobs))

    async def _collect(self, prep: Prepared, state: RouterRequest, first: TokenDelta, deltas):
        try:
            self._start(prep, state, first)
            async with aclosing(deltas):
                async for event in self._events(prep, state, first, deltas):
                    del event  # each choice's text.text accumulates its pieces
        except EngineFailure as exc:
            self._observe_failed(state)
            raise APIError(502, f"Engine failure: {exc}", "engine_error",
                           code="engine_failure") from None
        self._observe_done(state)
        return JSONResponse({
            "id": prep.req_id, "object": _OBJECT[prep.kind], "created": prep.created,
            "model": prep.model, "choices": [self._choice_body(prep, c) for c in state.choices],
            "usage": _usage(state)})

    @staticmethod
    def _choice_body(prep: Prepared, choice: RouterChoice) -> dict:
        text = choice.text
        body = {"index": choice.index, "logprobs": choice.logprobs_body(prep.logprobs),
                "finish_reason": choice.finish_reason}
        if prep.tool_mode:
            fields, body["finish_reason"] = parse_answer(prep.tool_mode, text.text,
                                                         choice.finish_reason)
            body["message"] = {"role": "assistant", **fields}
        elif prep.kind == "chat":
            body["message"] = {"role": "assistant", "content": text.text}
        else:
            body["text"] = text.text
        return body

    async def _events(self, prep: Prepared, state: RouterRequest, first: TokenDelta,
                      deltas: AsyncIterator[TokenDelta]
                      ) -> AsyncIterator[tuple[RouterChoice, str, bool]]:
        """(choice, text delta, whether it just finished) until every choice has its finish
        reason. A piece may be empty: a token whose text is held back still has logprobs."""
        delta = first
        while True:
            choice = state.choices[delta.index]  # the dispatcher checked the index
            if not choice.finish_reason:  # one stopped by a stop string reads on
                event = self._advance(prep, choice, delta)
                if event is not None:
                    yield event
            if state.is_answered:
                return  # returning closes `deltas`: the engines abort what still runs
            try:
                delta = await deltas.__anext__()
            except StopAsyncIteration:  # the dispatcher always ends with finish reasons
                raise EngineFailure("the engine stream ended without a finish reason",
                                    started=True) from None

    def _advance(self, prep: Prepared, choice: RouterChoice,
                 delta: TokenDelta) -> tuple[RouterChoice, str, bool] | None:
        text = choice.text
        if prep.drop_output and not choice.num_deltas:
            # echo with max_tokens 0: the engines' one token is not shown
            delta = TokenDelta(delta.req_id, finish_reason=delta.finish_reason or "length")
        choice.num_deltas += 1
        piece, delta = self._add_text(prep, text, delta)
        choice.num_generated += len(delta.token_ids)
        self._add_logprobs(prep, delta, choice)
        if text.is_stopped:
            choice.finish_reason = "stop"
            self.metrics.aborts.labels("stop_string").inc()
        elif delta.finish_reason:
            piece += text.flush()
            choice.finish_reason = delta.finish_reason
        if piece or prep.logprobs or choice.finish_reason:
            return choice, piece, bool(choice.finish_reason)
        return None

    @staticmethod
    def _add_text(prep: Prepared, text, delta: TokenDelta) -> tuple[str, TokenDelta]:
        """The delta's text piece, and the delta cut after the token that completed a stop
        string: a delta of several tokens (an engine's kept speculative drafts) ends where
        one token at a time would have, in the usage count and the logprobs too."""
        ids = delta.token_ids
        if not prep.stop or len(ids) < 2:
            return text.add(ids), delta
        piece, used = "", 0
        while used < len(ids) and not text.is_stopped:
            piece += text.add(ids[used:used + 1])
            used += 1
        if used == len(ids):
            return piece, delta
        return piece, msgspec.structs.replace(
            delta, token_ids=ids[:used], logprobs=delta.logprobs[:used],
            top_token_ids=delta.top_token_ids[:used], top_logprobs=delta.top_logprobs[:used])

    async def _stream(self, prep: Prepared, state: RouterRequest, first: TokenDelta,
                      deltas) -> AsyncIterator[bytes]:
        usage_null = {"usage": None} if prep.include_usage else {}
        try:
            async with aclosing(deltas):
                self._start(prep, state, first)
                for c in state.choices:
                    if prep.kind == "chat":
                        yield self._chunk(prep, c.index, {"role": "assistant", "content": ""},
                                          None, usage_null)
                    elif prep.echo:
                        yield self._chunk(prep, c.index, c.text.text, None, usage_null,
                                          c.take_logprobs())
                async for choice, piece, finished in self._events(prep, state, first, deltas):
                    for chunk in self._event_chunks(prep, choice, piece, finished, usage_null):
                        yield chunk
            if prep.include_usage:
                yield _sse({"id": prep.req_id, "object": _CHUNK_OBJECT[prep.kind],
                            "created": prep.created, "model": prep.model, "choices": [],
                            "usage": _usage(state)})
            self._observe_done(state)
        except EngineFailure as exc:
            logger.warning("request %s failed mid-stream: %s", prep.req_id, exc)
            self._observe_failed(state)
            yield _sse(APIError(502, f"Engine failure: {exc}", "engine_error",
                                code="engine_failure").body())
        except asyncio.CancelledError:
            self.metrics.aborts.labels("client_gone").inc()
            raise
        yield b"data: [DONE]\n\n"

    def _event_chunks(self, prep: Prepared, choice: RouterChoice, piece: str, finished: bool,
                      usage_null: dict) -> list[bytes]:
        """The SSE chunks of one event: its text (a tool answer is parsed whole, at its end),
        then, when the choice finished, its finish reason."""
        chunks = []
        if not prep.tool_mode:
            logprobs = choice.take_logprobs()
            if piece or logprobs:
                chunks.append(self._chunk(prep, choice.index, piece, None, usage_null, logprobs))
        if finished:
            finish_reason = choice.finish_reason
            if prep.tool_mode:
                fields, finish_reason = parse_answer(prep.tool_mode, choice.text.text,
                                                     finish_reason)
                chunks.append(self._chunk(prep, choice.index, _tool_delta(fields), None,
                                          usage_null, choice.take_logprobs()))
            chunks.append(self._chunk(prep, choice.index, "", finish_reason, usage_null))
        return chunks

    def _chunk(self, prep: Prepared, index: int, content: str | dict, finish_reason: str | None,
               extra: dict, logprobs: dict | None = None) -> bytes:
        choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if prep.kind == "chat":
            choice["delta"] = content if isinstance(content, dict) else (
                {"content": content} if content else {})
        else:
            choice["text"] = content
        return _sse({"id": prep.req_id, "object": _CHUNK_OBJECT[prep.kind],
                     "created": prep.created, "model": prep.model, "choices": [choice], **extra})

    def _observe_done(self, state: RouterRequest) -> None:
        now = time.monotonic()
        self.metrics.recent.append((time.time() - (now - state.arrival),
                                    len(state.prompt_token_ids), state.num_generated()))
        longest = max(c.num_generated for c in state.choices)  # the choice that ends last
        self.metrics.outcomes.append(Outcome(
            time.time(), state.first_token_at - state.arrival,
            (now - state.first_token_at) / (longest - 1) if longest > 1 else 0.0, True))
        self.metrics.e2e.observe(now - state.arrival)
        self.metrics.prompt_tokens.inc(len(state.prompt_token_ids))
        self.metrics.generated_tokens.inc(state.num_generated())
        if state.api_key_name:
            tokens = self.metrics.api_key_tokens
            tokens.labels(state.api_key_name, "prompt").inc(len(state.prompt_token_ids))
            tokens.labels(state.api_key_name, "generated").inc(state.num_generated())

    def _observe_failed(self, state: RouterRequest) -> None:
        """A request that failed or was refused: outside every SLO (planner/signals.py)."""
        ttft_s = state.first_token_at - state.arrival if state.first_token_at else 0.0
        self.metrics.outcomes.append(Outcome(time.time(), ttft_s, 0.0, False))


_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def _usage(state: RouterRequest) -> dict:
    """The prompt once (it was prefilled once), the outputs of every choice."""
    num_prompt = len(state.prompt_token_ids)
    num_generated = state.num_generated()
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
            "prompt_tokens_details": {"cached_tokens": state.num_cached_tokens}}


def _tool_delta(fields: dict) -> dict:
    """A whole tool answer as one chunk's delta: the call (OpenAI's indexed tool-call delta,
    name and arguments at once), or the content of an "auto" answer."""
    if "tool_calls" not in fields:
        return {"content": fields["content"]}
    return {"tool_calls": [{"index": i, **call} for i, call in enumerate(fields["tool_calls"])]}


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class _ClientGone(Exception):
    """The HTTP client disconnected while its request was waiting on the engines."""


async def _unless_gone(request: Request, awaitable):
    """`awaitable`'s result, or _ClientGone once the client disconnects (it is cancelled then).

    A handler is not cancelled when its client leaves (only a streaming body is); watching
    lets the engines stop generating for nobody.
    """
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise _ClientGone()
    return work.result()


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
