"""What the router reads from a client, bounded: body size, body time, requests in flight, and
the time a connection may take to send its headers.

`RequestLimits` is plain ASGI in front of the app. For the generation endpoints it
1. answers 429 with Retry-After once `max_concurrent_requests` are in flight;
2. answers 413 when the declared Content-Length exceeds `max_request_bytes`, before reading;
3. reads the body itself (chunked or not), answering 413 as soon as it grows past the limit and
   408 when it takes longer than `body_timeout_s`;
4. hands the app the whole body, then the client's own `receive` (disconnects still reach it).
`HeaderTimeoutH11` is uvicorn's h11 protocol plus a deadline on each request's headers, which
uvicorn lacks (its keep-alive timer stops at the first byte, so a client dripping a header byte
a second would hold the connection for ever).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.openai_protocol import APIError

logger = logging.getLogger(__name__)

LIMITED_PATHS = ("/v1/completions", "/v1/chat/completions")
_CLOSE = {"Connection": "close"}  # an unread body is not worth reading: drop the connection


class RequestLimits:
    def __init__(self, app, max_request_bytes: int, max_concurrent_requests: int,
                 body_timeout_s: float, retry_after_s: int = 1):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.body_timeout_s = body_timeout_s
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in LIMITED_PATHS:
            return await self.app(scope, receive, send)
        if self.num_in_flight >= self.max_concurrent_requests:
            return await _respond(scope, receive, send, APIError(
                429, f"Too many requests in flight (limit {self.max_concurrent_requests}); "
                f"retry after {self.retry_after_s} s", "rate_limit_error",
                code="too_many_requests"), {"Retry-After": str(self.retry_after_s)})
        self.num_in_flight += 1
        try:
            await self._limited(scope, receive, send)
        finally:
            self.num_in_flight -= 1

    async def _limited(self, scope, receive, send):
        declared = _content_length(scope)
        if declared is not None and declared > self.max_request_bytes:
            return await _respond(scope, receive, send, self._too_large(f"{declared} bytes"),
                                  _CLOSE)
        try:
            async with asyncio.timeout(self.body_timeout_s):  # wait_for may drop a cancellation
                body = await self._read_body(receive)
        except _TooLarge:
            return await _respond(scope, receive, send, self._too_large("more than that"),
                                  _CLOSE)
        except TimeoutError:
            return await _respond(scope, receive, send, APIError(
                408, f"The request body did not arrive within {self.body_timeout_s} s",
                code="request_timeout"), _CLOSE)
        if body is None:  # the client left before its body was whole: nobody to answer
            return None
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, got: str) -> APIError:
        return APIError(413, f"Request body too large: the limit is {self.max_request_bytes} "
                        f"bytes (--max-request-bytes), got {got}", code="request_too_large")


class _TooLarge(Exception):
    pass


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 already refuses a malformed one; be safe anyway
                return None
    return None


async def _respond(scope, receive, send, exc: APIError, headers: dict | None = None) -> None:
    # The body may be left unread: the server closes the connection after this response.
    await JSONResponse(exc.body(), status_code=exc.status, headers=headers)(scope, receive, send)


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol; a request whose headers are not whole within
    `header_timeout_s` of the connection opening (or of the previous response) is dropped."""

    header_timeout_s = 10.0  # set per server by `protocol_with_header_timeout`

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._armed_cycle:
            self._header_timer.cancel()  # a new request's headers are in
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
        self._armed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is self._armed_cycle and not self.transport.is_closing():
            logger.debug("dropping %s: no whole request headers within %.1f s", self.client,
                         self.header_timeout_s)
            self.transport.close()


def protocol_with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutH11]:
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})


def uvicorn_limits(config) -> dict:
    """uvicorn's own limits, set on purpose rather than left to its defaults."""
    return {
        "http": protocol_with_header_timeout(config.header_timeout_s),
        "timeout_keep_alive": config.keep_alive_timeout_s,
        "timeout_graceful_shutdown": config.graceful_shutdown_s,
        # Request line plus headers; h11 answers 400 past it (its default, stated).
        "h11_max_incomplete_event_size": 16 * 1024,
        # No connection cap: uvicorn answers 503 past it; requests in flight are capped by
        # RequestLimits (429) and idle connections by the two timeouts above.
        "limit_concurrency": None,
        "backlog": 2048,
    }
